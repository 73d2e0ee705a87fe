"""The Semantic Router's classification API answered from the farm's signals.

`POST /api/v1/classify/intent`, `/pii`, `/security`, `/combined` and `/batch` are what a Semantic Router user calls to see
why a prompt would be routed or refused, without generating (its router's management API). The farm answers them
from `SemanticLayer.signals`: the same classifier, guards and model choice as a chat request, each stage run
whatever the others found, no cache. The shapes are in farm/openai/classify_schemas.py.
"""

from __future__ import annotations

from farm.config.semantic import normalize_type
from farm.openai import classify_schemas as s
from farm.semantic.classifier import SIGNAL_OF_RULE
from farm.semantic.layer import Signals


def _ms(sig: Signals) -> int:
    return round(sig.ms)


def intent(sig: Signals, opts: s.IntentOptions) -> s.IntentResponse:
    cat, route = sig.category, sig.route
    assert cat is not None and route is not None
    accepted = route.category is not None
    probabilities = None
    if opts.return_probabilities:
        probabilities = {cat.name: round(cat.confidence, 4),
                         **{n: round(c, 4) for n, c, _ in cat.alternatives if n != cat.name}}
    return s.IntentResponse(
        classification=s.IntentClassification(category=cat.name, confidence=round(cat.confidence, 4),
                                              processing_time_ms=_ms(sig), rule=cat.rule, accepted=accepted),
        recommended_model=route.model, routing_decision=route.category or "default",
        matched_signals={SIGNAL_OF_RULE[cat.rule]: [cat.name]} if accepted else {}, probabilities=probabilities)


def pii(sig: Signals, opts: s.PIIOptions) -> s.PIIResponse:
    if sig.pii is None:  # the PII guard is off
        return s.PIIResponse(has_pii=False, entities=[], security_recommendation="allow",
                             processing_time_ms=_ms(sig), enabled=False)
    wanted = {normalize_type(t) for t in opts.entity_types} if opts.entity_types else None
    floor = opts.confidence_threshold or 0.0
    found = [e for e in sig.pii if (wanted is None or e.type in wanted) and e.score >= floor]
    entities = [s.PIIEntity(type=e.type, value=e.text if opts.reveal_entity_text else f"[{e.type}]",
                            confidence=round(e.score, 4),
                            start_position=e.start if opts.return_positions else None,
                            end_position=e.end if opts.return_positions else None) for e in found]
    masked = None
    if opts.mask_entities:
        masked = sig.text
        for e in sorted(found, key=lambda e: -e.start):  # from the end: earlier offsets stay valid
            masked = f"{masked[:e.start]}[{e.type}]{masked[e.end:]}"
    return s.PIIResponse(has_pii=bool(found), entities=entities,
                         security_recommendation="block" if sig.pii_denied else "allow",
                         processing_time_ms=_ms(sig), denied_types=sorted(sig.pii_denied), masked_text=masked)


def security(sig: Signals, opts: s.SecurityOptions) -> s.SecurityResponse:
    jb = sig.jailbreak
    if jb is None:  # the jailbreak guard is off
        return s.SecurityResponse(is_jailbreak=False, risk_score=0.0, detection_types=[], confidence=0.0,
                                  recommendation="allow", patterns_detected=[], processing_time_ms=_ms(sig),
                                  enabled=False)
    blocked = jb.confidence >= sig.jailbreak_threshold
    types = [jb.type] if blocked else []
    reasoning = None
    if opts.include_reasoning:
        reasoning = (f"attack probability {jb.confidence:.3f} {'>=' if blocked else '<'} the threshold "
                     f"{sig.jailbreak_threshold:.3f}" + (f"; type {jb.type}" if blocked else ""))
    return s.SecurityResponse(
        is_jailbreak=blocked, risk_score=round(jb.confidence, 4), detection_types=types,
        confidence=round(jb.confidence if blocked else 1.0 - jb.confidence, 4),
        recommendation="block" if blocked else "allow", patterns_detected=types, processing_time_ms=_ms(sig),
        threshold=round(sig.jailbreak_threshold, 4), reasoning=reasoning)


def combined(sig: Signals, req: s.CombinedRequest) -> s.CombinedResponse:
    return s.CombinedResponse(intent=intent(sig, req.intent_options), pii=pii(sig, req.pii_options),
                              security=security(sig, req.security_options), processing_time_ms=_ms(sig))


def batch_result(sig: Signals, task: str, opts: s.IntentOptions) -> s.BatchResult:
    """One text of a batch, in the batch's one-label form."""
    if task == "intent":
        r = intent(sig, opts)
        return s.BatchResult(category=r.classification.category, confidence=r.classification.confidence,
                             processing_time_ms=_ms(sig), probabilities=r.probabilities)
    if task == "security":
        sec = security(sig, s.SecurityOptions())
        return s.BatchResult(category=sec.detection_types[0] if sec.is_jailbreak else "benign",
                             confidence=sec.confidence, processing_time_ms=_ms(sig))
    best = max(sig.pii or [], key=lambda e: e.score, default=None)
    return s.BatchResult(category=best.type if best else "NO_PII", confidence=round(best.score, 4) if best else 1.0,
                         processing_time_ms=_ms(sig))


def batch(sigs: list[Signals], task: str, opts: s.IntentOptions, ms: float) -> s.BatchResponse:
    """A batch's answer: each text's one label, and the statistics (low confidence: an intent below the
    request's `confidence_threshold`, by default below the classifier's, which the default model answers)."""
    results = [batch_result(sig, task, opts) for sig in sigs]
    if task != "intent":
        low = 0
    elif opts.confidence_threshold is not None:
        low = sum(r.confidence < opts.confidence_threshold for r in results)
    else:
        low = sum(sig.route is not None and sig.route.category is None for sig in sigs)
    dist: dict[str, int] = {}
    for r in results:
        dist[r.category] = dist.get(r.category, 0) + 1
    return s.BatchResponse(results=results, total_count=len(results), processing_time_ms=round(ms),
                           statistics=s.BatchStatistics(
                               category_distribution=dist, low_confidence_count=low,
                               avg_confidence=round(sum(r.confidence for r in results) / len(results), 4)))
