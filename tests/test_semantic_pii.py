"""PII recognizers and policies: validation rules, context words, near-misses, and the held-out goals."""

from __future__ import annotations

import pytest

from farm.semantic.config import PIIPolicy
from farm.semantic.datagen import read_jsonl
from farm.semantic.evaluate import pii_scores
from farm.semantic.pii import PIIDetector, iban_ok, luhn_ok, normalize_type


@pytest.fixture(scope="module")
def det() -> PIIDetector:
    return PIIDetector()


def types(det: PIIDetector, text: str) -> list[str]:
    return [e.type for e in det.detect(text)]


def test_seed_ssn_request(det):
    ents = det.detect("My SSN is 123-45-6789")
    assert [(e.type, e.text, e.label) for e in ents] == [("US_SSN", "123-45-6789", "B-US_SSN")]


@pytest.mark.parametrize("ssn", ["000-12-3456", "666-12-3456", "912-34-5678", "123-00-4567", "123-45-0000"])
def test_ssn_area_group_serial_rules(det, ssn):
    assert "US_SSN" not in types(det, f"My SSN is {ssn}")


def test_bare_ssn_needs_context(det):
    assert types(det, "social security number 123456789") == ["US_SSN"]
    assert "US_SSN" not in types(det, "Compute 123456789 modulo 7")


def test_credit_card_luhn_and_network(det):
    good = "4111 1111 1111 1111"
    assert luhn_ok(good.replace(" ", ""))
    assert types(det, f"my card is {good}") == ["CREDIT_CARD"]
    assert types(det, "my card is 4111 1111 1111 1112") == []  # one digit off: Luhn fails
    assert types(det, "amex 378282246310005") == ["CREDIT_CARD"]
    assert types(det, "order 1234 5678 9012 3452") == []  # Luhn-valid length but no issuer starts with 1


def test_iban_mod97(det):
    assert iban_ok("DE89370400440532013000")
    assert types(det, "IBAN DE89 3704 0044 0532 0130 00 please") == ["IBAN_CODE"]
    assert types(det, "IBAN DE89 3704 0044 0532 0130 01 please") == []
    ent = det.detect("pay GB82WEST12345698765432 TODAY")[0]
    assert ent.text == "GB82WEST12345698765432"  # stops at the country's length


def test_ip_addresses(det):
    assert types(det, "server 10.0.0.12 is down.") == ["IP_ADDRESS"]
    assert types(det, "host 2001:db8::8a2e:370:7334 answers") == ["IP_ADDRESS"]
    assert types(det, "999.10.10.10 is not an address") == []
    assert types(det, "Release 10.4.2.1 is out") == []
    assert types(det, "meet at 10:30:00") == []


def test_phone_email(det):
    assert types(det, "call (415) 555-0132 or +44 20 7946 0958") == ["PHONE_NUMBER", "PHONE_NUMBER"]
    assert types(det, "write to jane.doe@example.org") == ["EMAIL_ADDRESS"]
    assert types(det, "The meeting is on 2024-03-15") == []


def test_passport_and_licence_need_context(det):
    assert types(det, "my passport number is 912345678") == ["US_PASSPORT"]
    assert types(det, "the total is 912345678") == []
    assert types(det, "driver's license D1234567") == ["US_DRIVER_LICENSE"]
    assert types(det, "part number D1234567") == []


def test_person_names(det):
    assert types(det, "Please email Sarah Okafor today") == ["PERSON"]
    assert types(det, "My name is Zbigniew Brzezinski") == ["PERSON"]
    assert types(det, "Dr. Haddad will see you") == ["PERSON"]
    for benign in ("Will you help me?", "May I ask something?", "Grace periods are 15 days", "Mark the task done",
                   "The Treaty of Versailles"):
        assert types(det, benign) == [], benign


def test_policy_types():
    assert normalize_type("B-US_SSN") == "US_SSN"
    deny = PIIPolicy()
    assert deny.violations({"US_SSN"}) == {"US_SSN"}
    allow_email = PIIPolicy(allowed_types=["B-EMAIL_ADDRESS"])
    assert allow_email.violations({"EMAIL_ADDRESS", "PERSON"}) == {"PERSON"}
    open_but_ssn = PIIPolicy(allow_by_default=True, denied_types=["US_SSN"])
    assert open_but_ssn.violations({"EMAIL_ADDRESS"}) == set()
    assert open_but_ssn.violations({"US_SSN", "PERSON"}) == {"US_SSN"}
    with pytest.raises(ValueError, match="unknown PII type"):
        PIIPolicy(allowed_types=["SHOE_SIZE"])


def test_held_out_goals(det):
    scores = pii_scores(read_jsonl("pii_test.jsonl"), det)
    scores.pop("_errors")
    assert len(scores) == 9
    for t, s in scores.items():
        assert s["recall"] >= 0.95, (t, s)
        assert s["precision"] >= 0.90, (t, s)
