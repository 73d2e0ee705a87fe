"""The Semantic Router's classification API, its requests and responses (`POST /api/v1/classify/intent`, `/pii`,
`/security`, `/combined`, `/batch`; its apiserver's IntentRequest/IntentResponse, PIIRequest/PIIResponse, SecurityRequest/
SecurityResponse). The farm answers them from its own signals (farm/semantic/classify_api.py); `rule`,
`accepted`, `threshold`, `denied_types` and `enabled` are the farm's additions to the Router's fields."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Options(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the Router's other options are accepted, as its JSON decoding does


class IntentOptions(_Options):
    return_probabilities: bool = False
    # an answer below it counts as low confidence in a batch's statistics (default: the classifier's own threshold,
    # below which the default model answers); the routing decision itself is the farm's, whatever a caller asks
    confidence_threshold: float | None = Field(None, ge=0.0, le=1.0)


class PIIOptions(_Options):
    entity_types: list[str] | None = None  # only these types (the farm's or the Router's names)
    return_positions: bool = False
    mask_entities: bool = False
    reveal_entity_text: bool = False  # the entity's text in `value`; else its type in brackets
    # entities scored below it are not reported; the recommendation and denied_types stay the guard's own verdict
    confidence_threshold: float | None = Field(None, ge=0.0, le=1.0)


class SecurityOptions(_Options):
    include_reasoning: bool = False


MAX_TEXT_CHARS = 100_000  # one text's length, alone or in a batch


class _TextRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str = Field(max_length=MAX_TEXT_CHARS)

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("text cannot be empty")
        return v


class IntentRequest(_TextRequest):
    model: str | None = None  # the alias (or model) to choose for; default the first alias, "MoM"
    options: IntentOptions = IntentOptions()


class PIIRequest(_TextRequest):
    model: str | None = None  # whose PII policy decides the recommendation
    options: PIIOptions = PIIOptions()


class SecurityRequest(_TextRequest):
    options: SecurityOptions = SecurityOptions()


class CombinedRequest(_TextRequest):
    model: str | None = None
    intent_options: IntentOptions = IntentOptions()
    pii_options: PIIOptions = PIIOptions()
    security_options: SecurityOptions = SecurityOptions()


MAX_BATCH_TEXTS = 100  # the Semantic Router's default max_batch_size
# A batch's texts together: its PII pass runs on the process's one PII thread, before every other request's, and
# 100 texts of MAX_TEXT_CHARS would hold it for minutes.
MAX_BATCH_CHARS = MAX_TEXT_CHARS


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    texts: list[str] = Field(min_length=1, max_length=MAX_BATCH_TEXTS)
    task_type: Literal["intent", "pii", "security"] = "intent"
    options: IntentOptions = IntentOptions()

    @field_validator("texts")
    @classmethod
    def _texts(cls, v: list[str]) -> list[str]:
        for i, t in enumerate(v):
            if not t.strip():
                raise ValueError(f"texts[{i}] cannot be empty")
            if len(t) > MAX_TEXT_CHARS:
                raise ValueError(f"texts[{i}] is longer than {MAX_TEXT_CHARS} characters")
        if (total := sum(map(len, v))) > MAX_BATCH_CHARS:
            raise ValueError(f"the texts hold {total} characters together, more than {MAX_BATCH_CHARS}")
        return v


# -- responses -------------------------------------------------------------------------------------------------
class IntentClassification(BaseModel):
    category: str
    confidence: float
    processing_time_ms: int
    rule: str  # head | custom | keyword: which of the classifier's rules decided
    accepted: bool  # at or above semantic.classifier.threshold: the category routes


class IntentResponse(BaseModel):
    classification: IntentClassification
    recommended_model: str
    routing_decision: str  # the accepted category, or "default"
    matched_signals: dict[str, list[str]]  # domains | embeddings | keywords -> the category
    probabilities: dict[str, float] | None = None  # with options.return_probabilities


class PIIEntity(BaseModel):
    type: str
    value: str  # the entity's text with options.reveal_entity_text, else "[TYPE]"
    confidence: float
    start_position: int | None = None  # with options.return_positions
    end_position: int | None = None


class PIIResponse(BaseModel):
    has_pii: bool
    entities: list[PIIEntity]
    security_recommendation: str  # block | allow, by the answering model's PII policy
    processing_time_ms: int
    denied_types: list[str] = Field(default_factory=list)
    masked_text: str | None = None  # with options.mask_entities
    enabled: bool = True  # false: the PII guard is off on this farm


class SecurityResponse(BaseModel):
    is_jailbreak: bool
    risk_score: float  # the guard's probability that the text is an attack
    detection_types: list[str]
    confidence: float  # of the verdict given
    recommendation: str  # block | allow
    patterns_detected: list[str]
    processing_time_ms: int
    threshold: float | None = None
    reasoning: str | None = None  # with options.include_reasoning
    enabled: bool = True  # false: the jailbreak guard is off on this farm


class CombinedResponse(BaseModel):
    intent: IntentResponse
    pii: PIIResponse
    security: SecurityResponse
    processing_time_ms: int


class BatchResult(BaseModel):
    """One text's answer: its category (intent), the attack type or "benign" (security), or the most confident
    entity type or "NO_PII" (pii)."""

    category: str
    confidence: float
    processing_time_ms: int
    probabilities: dict[str, float] | None = None  # intent, with options.return_probabilities


class BatchStatistics(BaseModel):
    category_distribution: dict[str, int]
    avg_confidence: float
    low_confidence_count: int  # intent: below semantic.classifier.threshold (the default model answers them)


class BatchResponse(BaseModel):
    results: list[BatchResult]
    total_count: int
    processing_time_ms: int
    statistics: BatchStatistics


REQUEST_MODELS = (IntentRequest, PIIRequest, SecurityRequest, CombinedRequest, BatchRequest)
RESPONSE_MODELS = (IntentResponse, PIIResponse, SecurityResponse, CombinedResponse, BatchResponse)
