"""A backend of the gateway: one server (or upstream account) of one kind.

Each kind is a subclass in ``client.backends.kinds`` (Triton's in ``client.triton``), listed
once in the kind table of the config (``client.config.kinds``). A
kind owns its config keys (``section``, a model the gateway config is made of), how its
backends are built from the config, its health probe, and which requests it takes and in which
form (``plan``). What every kind shares lives here: the address, the health record
(``client.backends.health``), the in-flight count, and the plan of a caller whose API the kind
does not speak (through the request's native form).

A kind's config hooks (``from_config``, ``listed_urls``...) are given the gateway config, which
is made of every kind's section; each kind reads, and annotates, only its own section.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import httpx
from pydantic import BaseModel

from client.backends.callers import caller_translation
from client.backends.health import BackendHealth
from client.backends.plan import Plan
from client.backends.translation import SecretScrubber, StreamTranslator
from client.endpoints import Api, Endpoint
from client.gateway_request import GatewayRequest

if TYPE_CHECKING:
    from client.config.schema_common import ServerDNSConfig

#: Routing tiers: a request goes to the ``second`` tier only when no backend of the ``first``
#: can take it, and to the ``fallback`` tier (metered upstream accounts, "OpenAI jumpers") only
#: when no other can, or when the caller routes it there (``X-LLM-Route: openai``).
Tier = Literal["first", "second", "fallback"]
TIER_ORDER: dict[Tier, int] = {"first": 0, "second": 1, "fallback": 2}


@dataclass(eq=False)  # identity semantics: backends go in sets (e.g. "already tried")
class Backend(abc.ABC):
    """A model server (or upstream account) behind the gateway; one subclass per kind."""

    #: The kind's name, as the status table and metrics label it.
    kind: ClassVar[str]
    #: What one backend of the kind is called in messages ("a Triton server").
    noun: ClassVar[str]
    #: The kind's keys in the gateway config (``ClientConfig`` inherits from every section);
    #: the config hooks below are given the gateway config and read only this section.
    section: ClassVar[type[BaseModel]]
    #: True when the kind streams its token ids and finishes another server's broken stream
    #: from them (``protocol.resume``): our generating servers.
    is_resumable: ClassVar[bool] = False

    url: str
    health: BackendHealth = field(default_factory=BackendHealth)
    #: Requests the gateway has sent here and not finished (see ``InFlightLease``).
    num_in_flight: int = 0
    #: Monotonic time of the last request sent here (the fallback tier's keys take turns).
    last_used_at: float = 0.0

    def __post_init__(self) -> None:
        self.health.name = self.name

    # -- the kind's config section ---------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: BaseModel) -> list[Backend]:
        """Fresh backends of this kind for ``config``, in its order."""

    @classmethod
    def listed_urls(cls, config: BaseModel) -> list[str]:
        """The server addresses ``config`` lists for this kind (each may appear only once
        across all kinds; upstream accounts, which may share a base URL, list none)."""
        return []

    @classmethod
    def app_name_keys(cls) -> tuple[str, ...]:
        """Config keys whose entries may name a deployment app instead of a URL."""
        return ()

    @classmethod
    def dns_entry(cls, config: BaseModel) -> ServerDNSConfig | None:
        """The DNS name ``config`` discovers servers of this kind from, if any."""
        return None

    @classmethod
    def with_discovered(cls, config: BaseModel, urls: list[str]) -> dict[str, Any]:
        """The config keys (and values) that add the servers found at ``urls`` through DNS."""
        return {}

    # -- what the kind says about routing --------------------------------------------------

    #: The APIs whose callers the kind plans for itself (others go through the native form).
    apis: ClassVar[frozenset[Api]] = frozenset({"native", "openai"})
    #: The kind's routing tier (a kind with a tier setting overrides this with a property).
    tier: ClassVar[Tier] = "first"
    #: True when requests go through the host's HTTP(S)_PROXY (the outside world); our servers
    #: are on the local network, where such a proxy must not capture the calls.
    uses_proxy: ClassVar[bool] = False

    @property
    def is_fallback(self) -> bool:
        """True in the fallback tier (the one ``X-LLM-Route: openai`` picks, ``local`` skips)."""
        return self.tier == "fallback"

    @property
    def priority(self) -> int:
        """The tier's rank (lower is preferred)."""
        return TIER_ORDER[self.tier]

    @property
    def name(self) -> str:
        """The label of this backend in logs, metrics and the status table."""
        return self.url

    @property
    def identity(self) -> tuple[object, ...]:
        """What makes a configured backend the same one across config reloads."""
        return (self.kind, self.url)

    def adopt_settings(self, fresh: Backend) -> None:  # noqa: B027 (an optional hook)
        """Take the settings of ``fresh`` (the same backend, built from a reloaded config),
        keeping this one's state: health, load, circuit (kinds with settings override this)."""

    def serves(self, model: str) -> bool:
        """True when this backend announced ``model`` among its model ids."""
        return model in self.health.model_ids

    # -- requests --------------------------------------------------------------------------

    @abc.abstractmethod
    def plan(self, request: GatewayRequest) -> Plan:
        """Whether this backend can take ``request``, and in which form."""

    def plan_for(self, request: GatewayRequest) -> Plan:
        """:meth:`plan`, for a caller of any API (the forwarding side keeps the answer for the
        request: ``client.backends.plan_memo``).

        A caller of an API the kind does not speak (not in :attr:`apis`) is served through
        the request's native form: the kind plans that, and a caller-side translation turns
        the native answers back into the caller's API.
        """
        if request.endpoint.api in self.apis:
            return self.plan(request)
        native_form = request.native_form()
        if native_form is None:
            return without_native_form(request, self.noun)
        plan = self.plan(native_form)
        if not plan.is_accepted:
            return plan
        return Plan(translation=caller_translation(request, plan.translation))

    def upstream_model(self, model: str | None) -> str | None:
        """The model id to send upstream for the gateway's ``model`` (same id here)."""
        return model

    def url_for(self, path: str) -> str:
        """The upstream address of an API path such as ``/v1/chat/completions``."""
        return self.url + path

    def request_headers(self) -> dict[str, str]:
        """Headers added to every forwarded request (kinds with a key add it here)."""
        return {}

    @property
    def secret(self) -> str:
        """The credential this backend is called with ("" when none); it is masked in
        everything the backend's answers carry back."""
        return ""

    def scrub(self, text: str) -> str:
        """``text`` (an upstream error) without this backend's secret."""
        return text.replace(self.secret, "***") if self.secret else text

    def stream_filter(self, translator: StreamTranslator | None) -> StreamTranslator | None:
        """What every streamed byte from this backend goes through: ``translator``, if any,
        and a scrubber when there is a secret (an error event may quote it)."""
        return SecretScrubber(self.secret, translator) if self.secret else translator

    # -- what requests tell ----------------------------------------------------------------

    def on_request_sent(self) -> None:
        """A request was just sent here."""
        self.last_used_at = time.monotonic()

    def on_unreachable(self, error: str, cooldown_seconds: float) -> None:
        """A request could not connect: out of rotation until a heartbeat finds it up again
        (kinds without heartbeats rest for ``cooldown_seconds`` instead)."""
        self.health.mark_unreachable(error)

    def on_overloaded(  # noqa: B027 (an optional hook)
        self, retry_after_seconds: float | None, cooldown_seconds: float
    ) -> None:
        """The backend answered 429/503; servers report their queue in heartbeats, so nothing
        more to do here (upstream accounts rest)."""

    def refuses_credentials(self, status: int) -> bool:
        """True when ``status`` means the gateway's own credentials were refused (then the
        backend rests itself); servers that take no credentials never say so."""
        return False

    # -- heartbeats ------------------------------------------------------------------------

    @abc.abstractmethod
    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """Check the backend and record the result in :attr:`health`; never raises for
        network or protocol problems (they mark the backend down)."""


def without_native_form(request: GatewayRequest, noun: str) -> Plan:
    """The refusal of a kind that needs ``request``'s native form when there is none: the body
    is invalid (the caller gets its 400 if no backend takes the request as sent), or it asks
    what the native API cannot (embeddings, several prompts, token-id prompts)."""
    error = request.native_error
    if error is not None:
        return Plan(refusal=error.message, error=error)
    if request.endpoint == Endpoint.EMBEDDINGS or not request.endpoint.has_native_form:
        return Plan(refusal=f"{noun}s do not answer {request.endpoint}")
    return Plan(refusal=f"{noun}s take one text prompt or one conversation per request")
