"""Request planning: whether a backend takes a request, and in which form."""

from __future__ import annotations

from dataclasses import dataclass

from client.backends.translation import Translation
from utils.errors import APIError


@dataclass(frozen=True)
class Plan:
    """How a backend would take a request: refused (``refusal`` says why), or in which form
    (``translation``; None: the caller's body goes unchanged, to ``path`` when the backend's
    path differs from the caller's, as the model in a Triton path does)."""

    refusal: str | None = None
    translation: Translation | None = None
    path: str | None = None
    #: For a refusal because the body is invalid in the meaning the backend needs: the 400
    #: the caller gets when every backend refuses so.
    error: APIError | None = None

    @property
    def is_accepted(self) -> bool:
        """True when the backend can take the request."""
        return self.refusal is None


#: The caller's request, as sent.
AS_SENT = Plan()
