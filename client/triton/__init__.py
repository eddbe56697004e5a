"""Triton's wing of the gateway: everything about Triton's generate API in one place.

- ``protocol``: the API's requests (TensorRT-LLM's fields) and conversions to and from native;
- ``responses``: its answers, and native answers turned into them;
- ``call`` and ``intake``: Triton callers on the gateway (``/v2/models/{model}/generate``);
- ``from_triton``: a Triton caller's answers when a backend answers in native terms;
- ``server_kind``, ``config`` and ``to_triton``: Triton servers as a backend kind, native
  requests sent to them, and ``chat_templates`` for chats they cannot render.

A Triton caller served by a Triton server passes through untouched.
"""
