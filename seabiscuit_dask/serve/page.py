"""The chat page at ``/``: pick a model, type a prompt, watch the answer stream.

``chat.html`` is one self-contained file (no scripts from elsewhere): it lists the models
from ``/v1/models`` and streams ``/v1/chat/completions`` with ``fetch``, keeping the
conversation; with a server that wants a key it asks for one.
"""

from pathlib import Path

PAGE = Path(__file__).with_name("chat.html").read_text(encoding="utf-8")
