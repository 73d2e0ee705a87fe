"""PII recognizers: regular expressions confirmed by checksums, number rules and context words.

Why our own and not Presidio: Presidio's useful recognizers for these types are the same regex +
checksum + context idea, but it pulls spaCy and a language model into every API process. Each
recognizer here finds candidates with a pattern and keeps only those that validate (Luhn for cards,
the SSA's area/group/serial rules for SSNs, ISO 13616 mod-97 and country length for IBANs, `ipaddress`
for IP addresses) or that sit next to a context word (passport, driver's licence). Person names come
from a closed list of given names plus titles and "my name is" cues. Types are Presidio's names; the
response header carries them BIO-style (`B-US_SSN`), as the vLLM Semantic Router does.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from farm.semantic.data.names import AMBIGUOUS_FIRST_NAMES, FIRST_NAMES

PII_TYPES = ("PERSON", "EMAIL_ADDRESS", "PHONE_NUMBER", "US_SSN", "CREDIT_CARD", "IP_ADDRESS", "IBAN_CODE",
             "US_PASSPORT", "US_DRIVER_LICENSE")
# Overlapping candidates: the earlier type wins (an email's local part is not a name, a card is not a phone).
_PRIORITY = {t: i for i, t in enumerate(("EMAIL_ADDRESS", "IBAN_CODE", "CREDIT_CARD", "US_SSN", "IP_ADDRESS",
                                         "PHONE_NUMBER", "US_PASSPORT", "US_DRIVER_LICENSE", "PERSON"))}


@dataclass(frozen=True)
class Entity:
    type: str
    start: int
    end: int
    text: str

    @property
    def label(self) -> str:
        """The header form, e.g. B-US_SSN."""
        return f"B-{self.type}"


def normalize_type(name: str) -> str:
    """`B-US_SSN`, `I-us_ssn` and `US_SSN` all mean US_SSN (config may use either form)."""
    name = name.strip().upper()
    return name[2:] if name[:2] in ("B-", "I-") else name


# -- validators ------------------------------------------------------------------------------------------
def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def card_network_ok(digits: str) -> bool:
    """Known issuer prefixes and lengths (Visa, Mastercard, Amex, Discover, JCB, Diners)."""
    n = len(digits)
    if digits[0] == "4":
        return n in (13, 16, 19)
    if 51 <= int(digits[:2]) <= 55 or 2221 <= int(digits[:4]) <= 2720:
        return n == 16
    if digits[:2] in ("34", "37"):
        return n == 15
    if digits.startswith(("6011", "65")) or 644 <= int(digits[:3]) <= 649:
        return 16 <= n <= 19
    if digits[:2] == "35":
        return 16 <= n <= 19
    if digits[:2] in ("36", "38", "30"):
        return 14 <= n <= 19
    return False


def ssn_ok(area: str, group: str, serial: str) -> bool:
    """SSA rules: no area 000, 666 or 900-999; no group 00; no serial 0000."""
    a = int(area)
    return a != 0 and a != 666 and a < 900 and group != "00" and serial != "0000"


IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AT": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29, "CH": 21, "CY": 28, "CZ": 24, "DE": 22,
    "DK": 18, "EE": 20, "ES": 24, "FI": 18, "FR": 27, "GB": 22, "GI": 23, "GR": 27, "HR": 21, "HU": 28, "IE": 22,
    "IL": 23, "IS": 26, "IT": 27, "KW": 30, "KZ": 20, "LB": 28, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27,
    "MT": 31, "NL": 18, "NO": 15, "PL": 28, "PT": 25, "QA": 29, "RO": 24, "SA": 24, "SE": 24, "SI": 19, "SK": 24,
    "SM": 27, "TR": 26,
}


def iban_ok(iban: str) -> bool:
    if IBAN_LENGTHS.get(iban[:2]) != len(iban) or not iban[2:4].isdigit():
        return False
    rearranged = iban[4:] + iban[:4]
    try:
        return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1
    except ValueError:
        return False


# -- patterns --------------------------------------------------------------------------------------------
_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}\b")
_CARD = re.compile(r"(?<![\w-])\d(?:[ -]?\d){12,18}(?![\w-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
_SSN = re.compile(r"(?<![\w-])(\d{3})([- ])(\d{2})\2(\d{4})(?![\w-])")
_SSN_BARE = re.compile(r"(?<![\w-])(\d{3})(\d{2})(\d{4})(?![\w-])")
_SSN_CONTEXT = re.compile(r"\b(?:ssn|social security(?: number| no\.?)?)\b", re.I)
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\w|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:|:){2,7}(?::|[0-9A-Fa-f]{1,4})(?![\w:])")
_VERSION_CONTEXT = re.compile(r"\b(?:version|release|v|ver|build|python|node|chrome|firefox)\s*$", re.I)
_PHONE_NANP = re.compile(
    r"(?<![\w+-])(?:\+?1[ .-]?)?(?:\([2-9]\d{2}\) ?|[2-9]\d{2}[ .-])[2-9]\d{2}[ .-]\d{4}(?![\w-])")
_PHONE_INTL = re.compile(r"(?<![\w+])\+(?!1\b)[2-9]\d{0,2}(?:[ .-]?\(?\d{1,5}\)?){2,5}(?![\w-])")
_PASSPORT_CONTEXT = re.compile(r"\bpassports?\b(?: (?:number|no\.?|num|#))?[:#]?", re.I)
_PASSPORT = re.compile(r"\b(?:[A-Z]\d{8}|\d{9})\b")
_DL_CONTEXT = re.compile(r"\b(?:driver'?s?|driving)[ -]licen[cs]e\b|\blicen[cs]e (?:number|no\.?|#)|\bDL ?#?", re.I)
_DL = re.compile(r"\b(?:[A-Z]{1,2}\d{5,13}|\d{7,12})\b")
_CAP = r"[A-Z][a-z]+(?:[-'][A-Z][a-z]+)?"
_TITLE_NAME = re.compile(rf"\b(?:Mr|Mrs|Ms|Miss|Dr|Prof|Sir|Madam)\.? ({_CAP}(?: {_CAP})?)")
_NAME_CUE = re.compile(rf"\b(?:[Mm]y name is|[Nn]amed|[Cc]all me|[Ss]igned|[Rr]egards,|[Dd]ear) ({_CAP}(?: {_CAP})?)")
_CAP_WORD = re.compile(rf"\b{_CAP}\b")
_NOT_SURNAME = frozenset("""The A An And Or But If In On At To For Of From By With About As Is Are Was Were Be Has Have
Had Do Does Did Will Would Can Could Should May Might Must This That These Those It Its I You He She We They Me
Him Her Us Them My Your His Our Their Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February
March April June July August September October November December Street Avenue Road University College Inc
Ltd Corp Company""".split())


def _context_before(text: str, start: int, pattern: re.Pattern[str], window: int) -> bool:
    return pattern.search(text, max(0, start - window), start) is not None


def _context_near(text: str, start: int, end: int, pattern: re.Pattern[str], window: int) -> bool:
    return pattern.search(text[max(0, start - window):min(len(text), end + window)]) is not None


class PIIDetector:
    """Finds PII entities in text; `detect` returns them without overlaps, in text order."""

    def __init__(self, types: tuple[str, ...] = PII_TYPES) -> None:
        self.types = frozenset(types)

    def detect(self, text: str) -> list[Entity]:
        cands: list[Entity] = []
        add = cands.append
        for m in _EMAIL.finditer(text):
            add(Entity("EMAIL_ADDRESS", m.start(), m.end(), m.group()))
        for m in _IBAN.finditer(text):
            ent = self._iban(text, m)
            if ent:
                add(ent)
        for m in _CARD.finditer(text):
            digits = re.sub(r"\D", "", m.group())
            if 13 <= len(digits) <= 19 and len(set(digits)) > 1 and card_network_ok(digits) and luhn_ok(digits):
                add(Entity("CREDIT_CARD", m.start(), m.end(), m.group()))
        for m in _SSN.finditer(text):
            if ssn_ok(m.group(1), m.group(3), m.group(4)):
                add(Entity("US_SSN", m.start(), m.end(), m.group()))
        for m in _SSN_BARE.finditer(text):
            if ssn_ok(m.group(1), m.group(2), m.group(3)) and _context_before(text, m.start(), _SSN_CONTEXT, 40):
                add(Entity("US_SSN", m.start(), m.end(), m.group()))
        for m in _IPV4.finditer(text):
            if all(int(p) <= 255 for p in m.group().split(".")) and not _VERSION_CONTEXT.search(text[:m.start()]):
                add(Entity("IP_ADDRESS", m.start(), m.end(), m.group()))
        for m in _IPV6.finditer(text):
            try:
                ipaddress.IPv6Address(m.group())
            except ValueError:
                continue
            add(Entity("IP_ADDRESS", m.start(), m.end(), m.group()))
        for m in _PHONE_NANP.finditer(text):
            add(Entity("PHONE_NUMBER", m.start(), m.end(), m.group()))
        for m in _PHONE_INTL.finditer(text):
            if 8 <= sum(c.isdigit() for c in m.group()) <= 15:
                add(Entity("PHONE_NUMBER", m.start(), m.end(), m.group()))
        for m in _PASSPORT.finditer(text):
            if _context_before(text, m.start(), _PASSPORT_CONTEXT, 30):
                add(Entity("US_PASSPORT", m.start(), m.end(), m.group()))
        for m in _DL.finditer(text):
            if _context_near(text, m.start(), m.end(), _DL_CONTEXT, 30) and any(c.isdigit() for c in m.group()):
                add(Entity("US_DRIVER_LICENSE", m.start(), m.end(), m.group()))
        self._persons(text, add)
        return self._resolve([c for c in cands if c.type in self.types])

    @staticmethod
    def _iban(text: str, m: re.Match[str]) -> Entity | None:
        """Take exactly the country's IBAN length of characters (the pattern may run into the next word)."""
        want = IBAN_LENGTHS.get(m.group()[:2])
        if not want:
            return None
        got, end = 0, m.start()
        for i in range(m.start(), m.end()):
            if text[i] != " ":
                got += 1
                if got == want:
                    end = i + 1
                    break
        if got != want:
            return None
        compact = text[m.start():end].replace(" ", "")
        return Entity("IBAN_CODE", m.start(), end, text[m.start():end]) if iban_ok(compact) else None

    @staticmethod
    def _persons(text: str, add) -> None:
        for pat in (_TITLE_NAME, _NAME_CUE):
            for m in pat.finditer(text):
                name = m.group(1)
                words = name.split()
                if words[-1] in _NOT_SURNAME:
                    words = words[:-1]
                if words and words[0] not in _NOT_SURNAME:
                    s = m.start(1)
                    add(Entity("PERSON", s, s + len(" ".join(words)), " ".join(words)))
        caps = list(_CAP_WORD.finditer(text))
        for i, m in enumerate(caps):
            first = m.group()
            if first not in FIRST_NAMES and first not in AMBIGUOUS_FIRST_NAMES:
                continue
            nxt = caps[i + 1] if i + 1 < len(caps) else None
            if nxt is not None and nxt.start() == m.end() + 1 and text[m.end()] == " " \
                    and nxt.group() not in _NOT_SURNAME:
                add(Entity("PERSON", m.start(), nxt.end(), text[m.start():nxt.end()]))
            elif first not in AMBIGUOUS_FIRST_NAMES:
                # a lone given name counts unless it is also a common word ("Will", "May", "Grace")
                add(Entity("PERSON", m.start(), m.end(), first))

    @staticmethod
    def _resolve(cands: list[Entity]) -> list[Entity]:
        """Drop candidates overlapping a better one (type priority, then longer span)."""
        cands.sort(key=lambda e: (_PRIORITY[e.type], -(e.end - e.start), e.start))
        kept: list[Entity] = []
        for e in cands:
            if all(e.end <= k.start or e.start >= k.end for k in kept):
                kept.append(e)
        kept.sort(key=lambda e: e.start)
        return kept
