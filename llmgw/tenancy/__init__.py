"""Tenancy: what the gateways and the server share to hold API keys to their limits.

:mod:`llmgw.tenancy.bucket` is the token bucket both count rates with: each
gateway process for its own admission (:mod:`llmgw.gateway.admission`), the
server for the whole fleet's (:mod:`llmgw.server.state.allowances`).
"""
