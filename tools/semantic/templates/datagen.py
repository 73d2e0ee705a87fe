"""The project's own template-made data sets (tools/semantic/templates/data/*.jsonl), deterministically.

    python -m tools.semantic.templates.datagen

These are phrase lists and templates written here (issue 8). Issue 15 showed they measure the heads on
their own generator: they are kept as *template-made* sets, reported apart from the real held-out data in
bench/semantic.py, and the jailbreak guard uses the benign near-misses of `jailbreak_train.jsonl` as one
documented source of hard negatives (security education, role-play, fiction, medicine). The category head
is trained on real questions only.

Every set has a train (or dev) part and a held-out `test` part built from disjoint topics, templates,
phrases, payloads, carrier sentences and random seeds: the held-out part is never trained on (the
heads are trained from `*_train.jsonl` only) and the PII recognizers were written against `pii_dev`.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterable
from pathlib import Path

from tools.semantic.templates import cache_src, categories_src, jailbreak_src, names

DATA_DIR = Path(__file__).resolve().parent / "data"


def _write(name: str, rows: Iterable[dict]) -> int:
    rows = list(rows)
    with open(DATA_DIR / name, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(rows)


def read_jsonl(name: str) -> list[dict]:
    """Rows of one data file (used by training, tests and the benchmark)."""
    with open(DATA_DIR / name) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- categories -------------------------------------------------------------------------------------------
def categories() -> tuple[list[dict], list[dict]]:
    train, test = [], []
    for cat, (tr_topics, te_topics) in categories_src.TOPICS.items():
        for j, t in enumerate(tr_topics):
            rng = random.Random(f"{cat}/{j}")
            for tpl in rng.sample(categories_src.TRAIN_TEMPLATES, categories_src.TEMPLATES_PER_TOPIC):
                text = tpl.format(t=t)
                train.append({"text": text[0].upper() + text[1:], "label": cat})
        for t in te_topics:
            for tpl in categories_src.HELD_OUT_TEMPLATES:
                test.append({"text": tpl.format(t=t), "label": cat})
        for q in categories_src.HELD_OUT_QUESTIONS[cat]:
            test.append({"text": q, "label": cat})
    return train, test


# -- jailbreak ----------------------------------------------------------------------------------------------
def _attacks(split: int, rng: random.Random) -> list[dict]:
    s = jailbreak_src
    rows = []
    joins = [". ", " and ", ", then ", ": "] if split == 0 else [" and ", ". Now "]
    for phrase in s.OVERRIDE_PHRASES[split]:
        for p in s.HARMFUL_PAYLOADS[split]:
            rows.append({"text": f"{phrase}{rng.choice(joins)}{p}", "label": "instruction_override"})
    for tpl in s.ROLEPLAY_TEMPLATES[split]:
        for p in s.HARMFUL_PAYLOADS[split]:
            rows.append({"text": tpl.format(p=p), "label": "roleplay"})
    for pre in s.EXTRACTION_PREFIXES[split]:
        for q in s.EXTRACTION_PROMPTS[split]:
            rows.append({"text": pre + q, "label": "prompt_extraction"})
    return rows


def _personas(part: int, n: int, rng: random.Random) -> list[str]:
    """`n` distinct benign role-play requests from one part (0 train, 1 held out) of the persona lists."""
    s = jailbreak_src
    combos = [t.format(persona=p, task=k) for t in s.BENIGN_PERSONA_TEMPLATES[part]
              for p in s.BENIGN_PERSONAS[part] for k in s.BENIGN_PERSONA_TASKS[part]]
    out = rng.sample(combos, min(n, len(combos)))
    return [x[0].upper() + x[1:] for x in out]


def jailbreak(cat_train: list[dict], cat_test: list[dict]) -> tuple[list[dict], list[dict]]:
    s = jailbreak_src
    rng = random.Random(8)
    train = _attacks(0, rng)
    train += [{"text": t, "label": "benign"} for t in s.BENIGN_HARD + s.BENIGN_PLAIN[0]]
    train += [{"text": t, "label": "benign"} for t in _personas(0, 240, random.Random(11))]
    # ordinary questions are benign too: a sample of the category training items
    train += [{"text": r["text"], "label": "benign"} for r in random.Random(1).sample(cat_train, 500)]
    test = _attacks(1, random.Random(9))
    test += [{"text": t, "label": "benign", "hard": True} for t in s.BENIGN_HARD_HELD]
    test += [{"text": t, "label": "benign", "hard": True} for t in _personas(1, 24, random.Random(12))]
    test += [{"text": t, "label": "benign"} for t in s.BENIGN_PLAIN[1]]
    test += [{"text": r["text"], "label": "benign"} for r in random.Random(2).sample(cat_test, 120)]
    return train, test


# -- PII ----------------------------------------------------------------------------------------------------
def _luhn_complete(prefix: str, length: int, rng: random.Random) -> str:
    body = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    total = 0
    for i, ch in enumerate(reversed(body)):
        d = int(ch)
        if i % 2 == 0:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return body + str((10 - total % 10) % 10)


def _card(rng: random.Random) -> str:
    kind = rng.choice(["visa", "mc", "amex", "disc"])
    if kind == "amex":
        n = _luhn_complete(rng.choice(["34", "37"]), 15, rng)
        return rng.choice([n, f"{n[:4]} {n[4:10]} {n[10:]}", f"{n[:4]}-{n[4:10]}-{n[10:]}"])
    n = _luhn_complete({"visa": "4", "mc": str(rng.randint(51, 55)), "disc": "6011"}[kind], 16, rng)
    sep = rng.choice(["", " ", "-"])
    return sep.join(n[i:i + 4] for i in range(0, 16, 4))


def _ssn(rng: random.Random) -> str:
    area = rng.choice([a for a in range(1, 900) if a != 666])
    s = f"{area:03d}{rng.randint(1, 99):02d}{rng.randint(1, 9999):04d}"
    return rng.choice([f"{s[:3]}-{s[3:5]}-{s[5:]}", f"{s[:3]}-{s[3:5]}-{s[5:]}", f"{s[:3]} {s[3:5]} {s[5:]}"])


def _iban(rng: random.Random) -> str:
    country, bban = rng.choice([
        ("DE", "".join(rng.choice(string.digits) for _ in range(18))),
        ("GB", "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(4))
         + "".join(rng.choice(string.digits) for _ in range(14))),
        ("FR", "".join(rng.choice(string.digits) for _ in range(23))),
        ("NL", "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(4))
         + "".join(rng.choice(string.digits) for _ in range(10))),
        ("ES", "".join(rng.choice(string.digits) for _ in range(20))),
    ])
    numeric = "".join(str(int(c, 36)) for c in bban + country + "00")
    iban = f"{country}{98 - int(numeric) % 97:02d}{bban}"
    return iban if rng.random() < 0.5 else " ".join(iban[i:i + 4] for i in range(0, len(iban), 4))


def _phone(rng: random.Random) -> str:
    a, b, c = rng.randint(201, 989), rng.randint(200, 999), rng.randint(0, 9999)
    return rng.choice([f"({a}) {b}-{c:04d}", f"{a}-{b}-{c:04d}", f"+1 {a} {b} {c:04d}", f"{a}.{b}.{c:04d}",
                       f"+44 20 {rng.randint(7000, 8999)} {rng.randint(1000, 9999)}",
                       f"+49 30 {rng.randint(100000, 999999)}", f"+1-{a}-{b}-{c:04d}"])


def _ipv4(rng: random.Random) -> str:
    return ".".join(str(x) for x in [rng.randint(1, 223), rng.randint(0, 255), rng.randint(0, 255), rng.randint(1, 254)])


def _ipv6(rng: random.Random) -> str:
    groups = [f"{rng.randint(0, 0xFFFF):x}" for _ in range(8)]
    if rng.random() < 0.5:
        return ":".join(groups)
    return "2001:db8::" + ":".join(groups[:2])


def _passport(rng: random.Random) -> str:
    return rng.choice([str(rng.randint(100000000, 999999999)),
                       rng.choice("ACEFGHJKLMNPRSTUVWXZ") + str(rng.randint(10000000, 99999999))])


def _dl(rng: random.Random) -> str:
    return rng.choice([rng.choice(string.ascii_uppercase) + str(rng.randint(1000000, 9999999)),  # CA
                       str(rng.randint(100000000, 999999999)),  # NY
                       rng.choice(string.ascii_uppercase) + str(rng.randint(100000000000, 999999999999)),  # FL
                       str(rng.randint(10000000, 99999999))])  # TX


def _person(rng: random.Random, surnames: list[str]) -> str:
    first = rng.choice(sorted(names.FIRST_NAMES))
    return f"{first} {rng.choice(surnames)}"


def _email(rng: random.Random, surnames: list[str]) -> str:
    first = rng.choice(sorted(names.FIRST_NAMES)).lower()
    dom = rng.choice(["gmail.com", "example.org", "company.co.uk", "mail.net", "uni-bonn.de", "outlook.com"])
    return f"{first}{rng.choice(['.', '_', ''])}{rng.choice(surnames).lower()}{rng.choice(['', str(rng.randint(1, 99))])}@{dom}"


PII_TEMPLATES = {
    # dev: the carriers the recognizers were written against; test: different carriers.
    "dev": {
        "US_SSN": ["My SSN is {v}", "social security number: {v}", "Please update my record, SSN {v}.", "The applicant's SSN is {v} and she lives in Ohio."],
        "CREDIT_CARD": ["Charge it to my card {v}", "card number {v} exp 04/27", "My Visa is {v}, is that safe to share?", "Pay with {v} please"],
        "EMAIL_ADDRESS": ["Email me at {v}", "Contact: {v}", "send the report to {v} by Friday", "my address is {v}"],
        "PHONE_NUMBER": ["Call me at {v}", "my phone number is {v}", "You can reach the office on {v}.", "Text {v} when you arrive"],
        "IP_ADDRESS": ["Our server at {v} is down", "block traffic from {v}", "ping {v} and tell me the result", "the host {v} refuses ssh"],
        "IBAN_CODE": ["Transfer the rent to IBAN {v}", "my bank account {v}", "Please wire 500 EUR to {v}.", "IBAN: {v}"],
        "US_PASSPORT": ["My passport number is {v}", "passport no. {v}, expires 2030", "Here is my passport: {v}"],
        "US_DRIVER_LICENSE": ["My driver's license number is {v}", "driver license {v}", "DL# {v} issued in 2019"],
        "PERSON": ["My name is {v}", "Please write a letter to {v} about the delay.", "{v} is my manager", "I met {v} yesterday at the conference"],
    },
    "test": {
        "US_SSN": ["Here is my social security number {v}, can you check it?", "SSN {v}", "I think {v} is my SSN but I'm not sure"],
        "CREDIT_CARD": ["Use credit card {v} for the order", "Is {v} a valid card?", "The payment card on file is {v}."],
        "EMAIL_ADDRESS": ["Forward everything to {v}", "Reply-To: {v}", "Can you write to {v} for me?"],
        "PHONE_NUMBER": ["Ring {v} after 6pm", "cell: {v}", "Customer called from {v} complaining about billing."],
        "IP_ADDRESS": ["Why does {v} show up in my nginx logs?", "Allow-list {v} in the firewall", "My laptop got the address {v} from DHCP"],
        "IBAN_CODE": ["Refund to {v} please", "Beneficiary account: {v}", "Is {v} a German account?"],
        "US_PASSPORT": ["Book the flight with passport {v}", "Passport number: {v}"],
        "US_DRIVER_LICENSE": ["License number {v} on my driver's licence", "My driving licence is {v}"],
        "PERSON": ["Dear {v}, thank you for your letter.", "Could you look up {v} in the staff directory?", "I need to email {v} today", "Schedule a call with {v}"],
    },
}

PII_NEGATIVES = {
    "dev": [
        "What is 123 + 456?", "My order number is 4000-1234-5678-9011", "The meeting is on 2024-03-15 at 10:30",
        "Version 1.2.3 of the library fixed the bug", "The invoice total was $1,234.56", "Call me tomorrow please",
        "Explain how IBANs are validated", "What is a social security number used for?", "Room 101, building 7",
        "Will you help me with my homework?", "May I ask a question about taxes?", "The ISBN is 978-3-16-148410-0",
        "Grace periods for loans are usually 15 days", "Python 3.11.4 is installed", "Send it to the marketing team",
        "The zip code is 94105", "Flight LH 400 departs at 13:05", "The SSN format has 9 digits", "Error code 0x80070005",
        "Add 3.14 and 2.71", "My passport expired last year, how do I renew it?", "Is 192.168 a valid IP?",
    ],
    "test": [
        "Order #5500-0000-0000-0005 was shipped", "The temperature was 98.6 degrees", "Meet me at 5 pm on Main Street",
        "Compute 987654321 modulo 7", "Release 10.4.2.1 is out", "What does an email address look like?",
        "Mark the task as done", "Rose bushes need pruning in spring", "Hope you are well",
        "Bill the client for 3 hours", "The serial number is 000-00-0000", "Tracking number 1Z999AA10123456784",
        "The year 1999 was great", "Apple reported revenue of 94.9 billion", "Phone calls cost 0.05 per minute",
        "I was born in 1988 and moved in 2001", "Use port 8080 on localhost", "Set the timeout to 30000 ms",
        "What is the passport office phone number format?", "Summer in Paris is lovely", "My driver's license expired",
    ],
}

VALUE_GENERATORS = {
    "US_SSN": _ssn, "CREDIT_CARD": _card, "PHONE_NUMBER": _phone, "IBAN_CODE": _iban,
    "US_PASSPORT": _passport, "US_DRIVER_LICENSE": _dl,
}


def _pii_value(kind: str, rng: random.Random, surnames: list[str]) -> str:
    if kind == "EMAIL_ADDRESS":
        return _email(rng, surnames)
    if kind == "PERSON":
        return _person(rng, surnames)
    if kind == "IP_ADDRESS":
        return _ipv4(rng) if rng.random() < 0.7 else _ipv6(rng)
    return VALUE_GENERATORS[kind](rng)


def pii(split: str, seed: int, per_type: int) -> list[dict]:
    rng = random.Random(seed)
    surnames = names.SURNAMES_DEV if split == "dev" else names.SURNAMES_TEST
    rows = []
    for kind, templates in PII_TEMPLATES[split].items():
        for i in range(per_type):
            tpl = templates[i % len(templates)]
            v = _pii_value(kind, rng, surnames)
            start = tpl.index("{v}")
            rows.append({"text": tpl.replace("{v}", v), "entities": [{"type": kind, "start": start, "end": start + len(v)}]})
    # two entities in one message: two carrier sentences joined
    for _ in range(per_type):
        a, b = rng.sample(sorted(PII_TEMPLATES[split]), 2)
        ta, tb = rng.choice(PII_TEMPLATES[split][a]), rng.choice(PII_TEMPLATES[split][b])
        va, vb = _pii_value(a, rng, surnames), _pii_value(b, rng, surnames)
        first = ta.replace("{v}", va).rstrip(".")
        text = f"{first}. Also, {tb.replace('{v}', vb)}"
        sa = ta.index("{v}")
        sb = len(first) + len(". Also, ") + tb.index("{v}")
        assert text[sa:sa + len(va)] == va and text[sb:sb + len(vb)] == vb
        rows.append({"text": text, "entities": [{"type": a, "start": sa, "end": sa + len(va)},
                                                {"type": b, "start": sb, "end": sb + len(vb)}]})
    rows += [{"text": t, "entities": []} for t in PII_NEGATIVES[split]]
    return rows


def main() -> None:
    cat_train, cat_test = categories()
    jb_train, jb_test = jailbreak(cat_train, cat_test)
    counts = {
        "categories_train.jsonl": _write("categories_train.jsonl", cat_train),
        "categories_test.jsonl": _write("categories_test.jsonl", cat_test),
        "jailbreak_train.jsonl": _write("jailbreak_train.jsonl", jb_train),
        "jailbreak_test.jsonl": _write("jailbreak_test.jsonl", jb_test),
        "pii_dev.jsonl": _write("pii_dev.jsonl", pii("dev", 11, 40)),
        "pii_test.jsonl": _write("pii_test.jsonl", pii("test", 12, 60)),
        "cache_pairs.jsonl": _write("cache_pairs.jsonl", (
            [{"a": a, "b": b, "same": True} for a, b in cache_src.PARAPHRASES]
            + [{"a": a, "b": b, "same": False} for a, b in cache_src.NEAR_MISSES])),
    }
    for name, n in counts.items():
        print(f"{name}: {n} rows")


if __name__ == "__main__":
    main()
