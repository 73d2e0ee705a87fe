"""PII detection (Presidio + spaCy) and policies: validation rules, context words, formats users really
write, public figures and addresses that must pass, and the default policy."""

from __future__ import annotations

import pytest

from farm.config.semantic import IDENTITY_TYPES, PII_TYPES, PIIConfig, PIIPolicy, normalize_type
from farm.semantic.pii import PIIDetector, ssn_ok


@pytest.fixture(scope="module")
def det() -> PIIDetector:
    return PIIDetector()


def found(det: PIIDetector, text: str) -> list[tuple[str, str]]:
    return [(e.type, e.text) for e in det.detect(text)]


def types(det: PIIDetector, text: str) -> set[str]:
    return {e.type for e in det.detect(text)}


def test_seed_ssn_request(det):
    ents = det.detect("My SSN is 123-45-6789")
    assert [(e.type, e.text, e.label) for e in ents] == [("US_SSN", "123-45-6789", "B-US_SSN")]


@pytest.mark.parametrize("text", ["My SSN is 123 45 6789", "ssn: 219-09-9999", "social security number 536225511"])
def test_ssn_formats(det, text):
    assert "US_SSN" in types(det, text)


@pytest.mark.parametrize("ssn", ["000-12-3456", "666-12-3456", "912-34-5678", "123-00-4567", "123-45-0000"])
def test_ssn_issuing_rules(det, ssn):
    assert not ssn_ok(ssn.replace("-", ""))
    assert "US_SSN" not in types(det, f"My SSN is {ssn}")


def test_bare_nine_digits_need_context(det):
    assert "US_SSN" not in types(det, "Compute 536225511 modulo 7")


def test_card_needs_luhn(det):
    assert found(det, "my card is 4111 1111 1111 1111") == [("CREDIT_CARD", "4111 1111 1111 1111")]
    assert "CREDIT_CARD" not in types(det, "my card is 4111 1111 1111 1112")  # one digit off


def test_iban_needs_mod97(det):
    assert ("IBAN_CODE", "DE89 3704 0044 0532 0130 00") in found(det, "IBAN DE89 3704 0044 0532 0130 00 please")
    assert "IBAN_CODE" not in types(det, "IBAN DE89 3704 0044 0532 0130 01 please")


@pytest.mark.parametrize(("text", "span"), [
    ("call me on +44 20 7946 0958", "+44 20 7946 0958"),       # UK, international
    ("my mobile is 07700 900123", "07700 900123"),             # UK, national
    ("Ruf mich an: +49 30 901820", "+49 30 901820"),          # Germany
    ("le bureau: +33 1 42 68 53 00", "+33 1 42 68 53 00"),     # France
    ("Call (415) 555-0132 after five", "(415) 555-0132"),      # US
])
def test_phone_numbers(det, text, span):
    assert ("PHONE_NUMBER", span) in found(det, text)


def test_addresses_of_machines_and_people(det):
    assert ("IP_ADDRESS", "192.168.1.1") in found(det, "Ping 192.168.1.1")
    assert ("IP_ADDRESS", "2001:db8::8a2e:370:7334") in found(det, "host 2001:db8::8a2e:370:7334 answers")
    both = found(det, "see https://example.com/a?b=1 or write to jane.doe@example.org")
    assert ("URL", "https://example.com/a?b=1") in both and ("EMAIL_ADDRESS", "jane.doe@example.org") in both
    assert not any(t == "URL" and "example.org" in s for t, s in both)  # the e-mail is not also a URL


def test_credentials(det):
    assert types(det, "my password is hunter22") == {"CREDENTIAL"}
    assert "CREDENTIAL" in types(det, "aws key AKIAIOSFODNN7EXAMPLE")
    assert "CREDENTIAL" not in types(det, "How do I choose a strong password?")


def test_passport_and_licence_need_context(det):
    assert "US_PASSPORT" in types(det, "my passport number is 912345678")
    assert "US_PASSPORT" not in types(det, "the total is 912345678")
    assert "US_DRIVER_LICENSE" in types(det, "driver's license D1234567")


def test_context_words_count_in_any_case_and_inflection(det):
    """spaCy runs its NER alone (no lemmatizer): lower-cased token text stands in for lemmas, and Presidio's
    substring match still finds its context words in capitalised and plural forms."""
    assert det.analyzer.nlp_engine.nlp["en"].pipe_names == ["ner", "farm_lower_lemmas"]
    assert "US_SSN" in types(det, "Social Security: 536225511")
    assert "US_PASSPORT" in types(det, "PASSPORTS on file: 912345678")
    assert "US_PASSPORT" not in types(det, "Totals on file: 912345678")


def test_names_places_dates_from_ner(det):
    got = found(det, "My name is John Smith and I live in Paris, born 3 May 1980")
    assert ("PERSON", "John Smith") in got and ("LOCATION", "Paris") in got and ("DATE_TIME", "3 May 1980") in got
    assert ("PERSON", "Albert Einstein") in found(det, "Summarize the life of Albert Einstein")
    assert found(det, "What is 2+2?") == []
    assert not any(t in ("ORGANIZATION", "DATE_TIME") for t, _ in found(det, "My SSN is 123 45 6789"))


def test_default_policy_blocks_identity_and_reports_the_rest():
    policy = PIIConfig().default_policy
    assert policy.violations({"PERSON", "IP_ADDRESS", "EMAIL_ADDRESS", "PHONE_NUMBER", "LOCATION", "DATE_TIME",
                              "ORGANIZATION", "URL"}) == set()
    assert policy.violations(set(IDENTITY_TYPES) | {"PERSON"}) == set(IDENTITY_TYPES)
    assert set(IDENTITY_TYPES) <= set(PII_TYPES)


def test_policy_types():
    assert normalize_type("B-US_SSN") == "US_SSN"
    deny_all = PIIPolicy()
    assert deny_all.violations({"US_SSN"}) == {"US_SSN"}
    allow_email = PIIPolicy(allowed_types=["B-EMAIL_ADDRESS"])
    assert allow_email.violations({"EMAIL_ADDRESS", "PERSON"}) == {"PERSON"}
    open_but_ssn = PIIPolicy(allow_by_default=True, denied_types=["US_SSN"])
    assert open_but_ssn.violations({"EMAIL_ADDRESS"}) == set()
    assert open_but_ssn.violations({"US_SSN", "PERSON"}) == {"US_SSN"}
    with pytest.raises(ValueError, match="unknown PII type"):
        PIIPolicy(allowed_types=["SHOE_SIZE"])


def test_no_phone_metadata_is_left_to_load_under_its_lock_on_a_request(det):
    """phonenumbers loads regions lazily under a lock that is gevent's in the API, taken from native threads:
    two requests contending for it hung for good. Once the detector exists, nothing is left to load."""
    from phonenumbers.phonemetadata import PhoneMetadata

    assert not [r for r, loader in PhoneMetadata._region_available.items() if loader is not None]
    assert not [c for c, loader in PhoneMetadata._country_code_available.items() if loader is not None]
    assert not [r for r, loader in PhoneMetadata._short_region_available.items() if loader is not None]


@pytest.mark.parametrize("shift", [0, 3595, 3598, 3990, 3996, 7190])
def test_a_long_text_is_read_in_windows_without_losing_or_doubling_a_finding(det, shift):
    """A long text is analysed in overlapping windows (one Presidio call over 160 KB of addresses took 38 s, its
    cost quadratic in the findings): a finding at any place, across a window's edge too, is reported once, where
    it is, as a short text's would be."""
    from farm.semantic.pii import WINDOW_CHARS

    filler = "The river runs past the old mill and on to the sea. "
    head = (filler * 300)[:shift]
    text = head + "Mail jane.doe@example.org today. " + (filler * 400)[:3 * WINDOW_CHARS]
    assert len(text) > 3 * WINDOW_CHARS
    at = text.index("jane.doe@example.org")
    hits = [e for e in det.detect(text) if e.type == "EMAIL_ADDRESS"]
    assert [(e.start, e.end, e.text) for e in hits] == [(at, at + 20, "jane.doe@example.org")]
    per = det.detect_many(["Call me.", text, "Ada Lovelace wrote it."])
    assert [(e.start, e.text) for e in per[1] if e.type == "EMAIL_ADDRESS"] == [(at, "jane.doe@example.org")]
    assert [e.type for e in per[2]] == ["PERSON"]


def test_a_long_pass_takes_the_analyzer_a_window_at_a_time(det):
    """The analyzer's thread is one per process and every request's PII pass queues for it. A long conversation's
    windows now take one turn each, so a short request that arrives meanwhile is answered between two of them,
    not after the whole pass (100,000 characters of addresses: 1.7 s of waiting for every other request)."""
    import threading
    import time

    long_text = "".join(f"u{i}@ex.com " for i in range(10_000))
    ended: dict[str, float] = {}

    def long_pass() -> None:
        det.detect_many([long_text])
        ended["long"] = time.perf_counter()

    th = threading.Thread(target=long_pass)
    th.start()
    time.sleep(0.3)  # the long pass is under way
    short = det.detect_many(["Mail jane.doe@example.org today."])
    ended["short"] = time.perf_counter()
    th.join()
    assert [e.type for e in short[0]] == ["EMAIL_ADDRESS"]
    assert ended["short"] < ended["long"] - 0.5, ended
