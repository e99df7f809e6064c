"""The rollout engine the tests use: upstream's RemoteSGLangEngine with the transport's receiver methods, the
same composition as the plugin's HexRemoteSGLangEngine (importable by path, for real RPC workers)."""

from __future__ import annotations

from areal.engine.sglang_remote import RemoteSGLangEngine

from areal_hex_plugin.transport import RelayReceiverMixin


class ReceiverEngine(RelayReceiverMixin, RemoteSGLangEngine):
    pass
