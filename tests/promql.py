"""A small PromQL evaluator over scraped /metrics text: what a Grafana panel or a KEDA trigger would get back.

It covers the PromQL the farm's dashboard, its chart's KEDA triggers and its alert rules
(deploy/prometheus/alerts.yml) use: selectors with =, !=, =~, !~, range selectors under rate/irate/increase
(computed from two scrapes: the value difference over the time between them) and delta (for gauges: the same
difference, no counter resets), sum/avg/min/max/count with `by`/`without`, histogram_quantile,
clamp_min/clamp_max, vector(s), `or`, `and`, `unless` (matched on equal label sets, the metric name aside),
the filtering comparisons == != > < >= <= (no `bool`), and + - * / between vectors (one-to-one on equal label
sets) and scalars, with PromQL's precedence (arithmetic, then comparisons, then and/unless, then or). Anything
else is a SyntaxError: a dashboard or a rule that uses more must teach this module first, not pass unchecked.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]  # one instant vector: label set (with __name__ for raw series) -> value


@dataclass
class Scrape:
    """Every sample of one /metrics answer, and when it was taken."""

    t: float
    samples: dict[Labels, float]

    @classmethod
    def parse(cls, text: str, t: float) -> Scrape:
        samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples[frozenset({**s.labels, "__name__": s.name}.items())] = float(s.value)
        return cls(t, samples)


_TOKEN = re.compile(r"""\s*(?:(?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")
                     |(?P<op>=~|!~|!=|==|>=|<=|[-+*/(){}\[\],=<>])|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*))""", re.X)
AGGREGATIONS = {"sum", "avg", "min", "max", "count"}
RANGE_FUNCTIONS = {"rate", "irate", "increase", "delta"}
COMPARISONS = ("==", "!=", ">", "<", ">=", "<=")


def tokenize(expr: str) -> list[str]:
    out, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise SyntaxError(f"cannot read {expr[pos:]!r} in {expr!r}")
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


class Evaluator:
    """Evaluate `expr` at the later of two scrapes (`before` feeds the range functions)."""

    def __init__(self, before: Scrape, after: Scrape):
        self.before, self.after = before, after

    def eval(self, expr: str) -> Vector | float:
        self.toks, self.i = tokenize(expr), 0
        self.expr = expr
        out = self._or()
        if self.i != len(self.toks):
            raise SyntaxError(f"unexpected {self.toks[self.i]!r} in {expr!r}")
        return out

    # -- parsing ------------------------------------------------------------------------------------------
    def _peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def _next(self, want: str | None = None) -> str:
        tok = self._peek()
        if tok is None or (want is not None and tok != want):
            raise SyntaxError(f"expected {want or 'more'} at token {self.i} of {self.expr!r}, got {tok!r}")
        self.i += 1
        return tok

    def _or(self):
        left = self._and()
        while self._peek() == "or":
            self._next()
            right = self._and()
            left = _or(left, right)
        return left

    def _and(self):
        left = self._comparison()
        while self._peek() in ("and", "unless"):
            keep = self._next() == "and"
            right = self._comparison()
            if not isinstance(left, dict) or not isinstance(right, dict):
                raise SyntaxError(f"and/unless between scalars in {self.expr!r}")
            names = {_drop_name(k) for k in right}
            left = {k: x for k, x in left.items() if (_drop_name(k) in names) == keep}
        return left

    def _comparison(self):
        left = self._additive()
        while self._peek() in COMPARISONS:
            op = self._next()
            if self._peek() == "bool":
                raise SyntaxError(f"`bool` comparisons are not supported here ({self.expr!r})")
            left = _compare(op, left, self._additive(), self.expr)
        return left

    def _additive(self):
        left = self._multiplicative()
        while self._peek() in ("+", "-"):
            op = self._next()
            left = _binary(op, left, self._multiplicative())
        return left

    def _multiplicative(self):
        left = self._unary()
        while self._peek() in ("*", "/"):
            op = self._next()
            left = _binary(op, left, self._unary())
        return left

    def _unary(self):
        if self._peek() == "-":
            self._next()
            return _binary("*", -1.0, self._unary())
        return self._primary()

    def _primary(self):
        tok = self._next()
        if tok == "(":
            out = self._or()
            self._next(")")
            return out
        if re.fullmatch(r"\d.*", tok):
            return float(tok)
        if tok in AGGREGATIONS:
            return self._aggregation(tok)
        if tok in RANGE_FUNCTIONS:
            self._next("(")
            name, matchers = self._selector_body(self._next())
            self._next("[")
            while self._next() != "]":
                pass
            self._next(")")
            return self._range(tok, name, matchers)
        if tok == "histogram_quantile":
            self._next("(")
            q = self._or()
            self._next(",")
            v = self._or()
            self._next(")")
            return _quantile(float(q), v)
        if tok in ("clamp_min", "clamp_max"):
            self._next("(")
            v = self._or()
            self._next(",")
            bound = float(self._or())
            self._next(")")
            fn = max if tok == "clamp_min" else min
            return {k: fn(x, bound) for k, x in v.items()}
        if tok == "vector":
            self._next("(")
            s = float(self._or())
            self._next(")")
            return {frozenset(): s}
        if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok):
            name, matchers = self._selector_body(tok)
            return self._select(self.after, name, matchers)
        raise SyntaxError(f"unexpected {tok!r} in {self.expr!r}")

    def _selector_body(self, name: str) -> tuple[str, list[tuple[str, str, str]]]:
        matchers = []
        if self._peek() == "{":
            self._next()
            while self._peek() != "}":
                label, op, value = self._next(), self._next(), self._next()
                if op not in ("=", "!=", "=~", "!~") or not value.startswith('"'):
                    raise SyntaxError(f"bad matcher {label}{op}{value} in {self.expr!r}")
                matchers.append((label, op, value[1:-1].encode().decode("unicode_escape")))
                if self._peek() == ",":
                    self._next()
            self._next("}")
        return name, matchers

    def _labels(self) -> list[str]:
        self._next("(")
        out = []
        while self._peek() != ")":
            out.append(self._next())
            if self._peek() == ",":
                self._next()
        self._next(")")
        return out

    def _aggregation(self, op: str) -> Vector:
        grouping, without = None, False
        if self._peek() in ("by", "without"):
            without = self._next() == "without"
            grouping = self._labels()
        self._next("(")
        v = self._or()
        self._next(")")
        if self._peek() in ("by", "without"):
            without = self._next() == "without"
            grouping = self._labels()
        return _aggregate(op, v, grouping, without)

    # -- evaluation ---------------------------------------------------------------------------------------
    @staticmethod
    def _select(scrape: Scrape, name: str, matchers: list[tuple[str, str, str]]) -> Vector:
        out = {}
        for labels, value in scrape.samples.items():
            d = dict(labels)
            if d.get("__name__") != name:
                continue
            if all(_match(d.get(label, ""), op, want) for label, op, want in matchers):
                out[labels] = value
        return out

    def _range(self, fn: str, name: str, matchers: list[tuple[str, str, str]]) -> Vector:
        now, then = self._select(self.after, name, matchers), self._select(self.before, name, matchers)
        dt = self.after.t - self.before.t
        out = {}
        for labels, v in now.items():
            if labels not in then:
                continue  # one sample: no rate, as in Prometheus
            delta = v - then[labels]
            if delta < 0 and fn != "delta":
                delta = v  # a counter reset (delta() is for gauges: a fall is a fall)
            key = frozenset((k, x) for k, x in labels if k != "__name__")
            out[key] = delta if fn in ("increase", "delta") else delta / dt
        return out


def _compare(op: str, a, b, expr: str):
    """PromQL's filtering comparison: the samples (of the vector side; the left one between vectors) for which
    it holds, their values unchanged. NaN compares false, as in Prometheus."""
    test = {"==": lambda x, y: x == y, "!=": lambda x, y: x != y, ">": lambda x, y: x > y,
            "<": lambda x, y: x < y, ">=": lambda x, y: x >= y, "<=": lambda x, y: x <= y}[op]
    if isinstance(a, float) and isinstance(b, float):
        raise SyntaxError(f"a comparison between scalars needs `bool` in {expr!r}")
    if isinstance(b, float):
        return {k: x for k, x in a.items() if test(x, b)}
    if isinstance(a, float):
        return {k: y for k, y in b.items() if test(a, y)}
    right = {_drop_name(k): y for k, y in b.items()}
    return {k: x for k, x in a.items() if _drop_name(k) in right and test(x, right[_drop_name(k)])}


def _match(value: str, op: str, want: str) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    hit = re.fullmatch(want, value) is not None
    return hit if op == "=~" else not hit


def _drop_name(labels: Labels) -> Labels:
    return frozenset((k, v) for k, v in labels if k != "__name__")


def _aggregate(op: str, v: Vector, grouping: list[str] | None, without: bool) -> Vector:
    groups: dict[Labels, list[float]] = {}
    for labels, x in v.items():
        d = dict(_drop_name(labels))
        if grouping is None:
            key = frozenset()
        elif without:
            key = frozenset((k, y) for k, y in d.items() if k not in grouping)
        else:
            key = frozenset((k, d[k]) for k in grouping if k in d)
        groups.setdefault(key, []).append(x)
    fn = {"sum": sum, "min": min, "max": max, "count": len, "avg": lambda xs: sum(xs) / len(xs)}[op]
    return {k: float(fn(xs)) for k, xs in groups.items()}


def _binary(op: str, a, b):
    calc = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
            "/": lambda x, y: x / y if y else (math.nan if x == 0 else math.copysign(math.inf, x))}[op]
    if isinstance(a, float) and isinstance(b, float):
        return calc(a, b)
    if isinstance(a, float):
        return {k: calc(a, y) for k, y in b.items()}
    if isinstance(b, float):
        return {_drop_name(k): calc(x, b) for k, x in a.items()}
    right = {_drop_name(k): y for k, y in b.items()}
    return {_drop_name(k): calc(x, right[_drop_name(k)]) for k, x in a.items() if _drop_name(k) in right}


def _or(a: Vector, b: Vector) -> Vector:
    out = {_drop_name(k): x for k, x in a.items()}
    for k, y in b.items():
        out.setdefault(_drop_name(k), y)
    return out


def _quantile(q: float, v: Vector) -> Vector:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket that holds the rank."""
    series: dict[Labels, list[tuple[float, float]]] = {}
    for labels, x in v.items():
        d = dict(_drop_name(labels))
        le = float(d.pop("le"))
        series.setdefault(frozenset(d.items()), []).append((le, x))
    out = {}
    for key, buckets in series.items():
        buckets.sort()
        total = buckets[-1][1]
        if total <= 0 or not math.isinf(buckets[-1][0]):
            out[key] = math.nan
            continue
        rank = q * total
        prev_le, prev_count = 0.0, 0.0
        for le, count in buckets:
            if count >= rank:
                if math.isinf(le):
                    out[key] = prev_le
                else:
                    width = count - prev_count
                    out[key] = prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 0)
                break
            prev_le, prev_count = le, count
    return out


def grafana_expr(expr: str, variables: dict[str, str]) -> str:
    """A panel's expression as Grafana sends it: $__rate_interval and the dashboard's variables filled in."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables[m.group(1)], expr)
