"""The request bodies of the OpenAI-compatible front (api/openai_front.py), as pydantic
models: what OpenAI's API and vLLM's extensions define for /v1/completions and
/v1/chat/completions, and hookwire's own body member ``hookwire`` (what the ``openai``
client's ``extra_body`` sends).

pydantic validates them (types, ranges), not hand-written code; a body member no model
here declares is refused (``extra="forbid"``): a field hookwire would silently ignore is
worse than a 400 naming it. Fields hookwire does not serve are declared so that their
no-op values pass (``user``, penalties 0, ``logit_bias: null``) and anything else is
refused naming the field (``refuse_unserved``). Converting a body into a GenerateRequest
is the front's (openai_front.py); this module only says what a valid body is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

#: What a GenerateRequest's uint32 fields carry: a larger count is refused here (400),
#: the server's own limits refuse most of what is below it, naming them.
UINT32 = (1 << 32) - 1
#: A token id as the wire carries it (int64), never negative; a JSON bool is not one.
TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 63)]



class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Body):
    """``stream_options``: a last chunk with the usage (``include_usage``)."""

    include_usage: bool | None = None
    #: vLLM's extension (usage on every chunk): accepted only off.
    continuous_usage_stats: bool | None = None


class HookwireOptions(_Body):
    """The ``hookwire`` body member: the call's tags (operators' SCOPE_TAGGED steering and
    monitoring hooks apply), its session (SCOPE_SESSION hooks and slots) and hooks of its
    own as HookSpec JSON (the proto's JSON mapping), validated as gRPC validates them."""

    tags: list[str] = Field(default_factory=list)
    session_id: str = ""
    hooks: list[dict[str, Any]] = Field(default_factory=list)


class _Sampling(_Body):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=UINT32)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions.
    top_k: int | None = Field(default=None, ge=-1, le=UINT32)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=UINT32)
    # Accepted at their no-op values only (refuse_unserved).
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    hookwire: HookwireOptions | None = None

    def unserved(self) -> list[tuple[str, str]]:
        """(field, why) for each field sent at a value hookwire does not serve."""
        out = []
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                out.append((name, f"hookwire does not serve penalties; send {neutral:g} or leave it out"))
        if self.logit_bias:
            out.append(("logit_bias", "hookwire does not serve logit biases; send null or leave it out"))
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            out.append(("stream_options.continuous_usage_stats",
                        "hookwire sends the usage once, in the last chunk (include_usage)"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "goes with stream: true"))
        return out


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    #: A text, texts, token ids, or lists of token ids (one prompt each).
    #: (Tried left to right, the first type that fits wins: one pass over a long list of
    #: token ids instead of every type of the union in turn.)
    prompt: str | list[TokenId] | list[list[TokenId]] | list[str] = Field(union_mode="left_to_right")
    #: The most likely tokens to report per position (0: the chosen token's alone).
    #: (At most the server's max_top_logprobs: Generate's check, naming it.)
    logprobs: int | None = Field(default=None, ge=0, le=UINT32)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1, le=UINT32)
    suffix: str | None = None

    def unserved(self) -> list[tuple[str, str]]:
        out = super().unserved()
        if self.best_of is not None and self.best_of != (self.n or 1):
            out.append(("best_of", "hookwire does not rank candidates; send n sequences instead"))
        if self.suffix:
            out.append(("suffix", "hookwire does not insert text; send null or leave it out"))
        return out


class ContentPart(_Body):
    """A part of a chat message's content: text only."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Body):
    type: str


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=UINT32)
    # Accepted at their no-op values only.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    store: bool | None = None
    # vLLM's extensions.
    add_generation_prompt: bool = True

    def unserved(self) -> list[tuple[str, str]]:
        out = super().unserved()
        if self.tools:
            out.append(("tools", "hookwire does not call tools; send null or leave it out"))
        if self.tool_choice not in (None, "none"):
            out.append(("tool_choice", "hookwire does not call tools; send \"none\" or leave it out"))
        if self.response_format is not None and self.response_format.type != "text":
            out.append(("response_format", "hookwire answers text only ({\"type\": \"text\"})"))
        if self.store:
            out.append(("store", "hookwire does not store completions; send false or leave it out"))
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", "goes with logprobs: true"))
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            out.append(("max_completion_tokens", "max_tokens says otherwise: send one of them"))
        return out
