"""handoff's KV connector for vLLM workers: vLLM's NIXL pull connector that acts on the
router's events (peer_gone, lease_release). Load it with

    --kv-transfer-config '{"kv_connector":"HandoffNixlConnector",
                           "kv_connector_module_path":"handoff_vllm.connector", ...}'

This package imports no vLLM until the connector module is loaded (see connector.py).
"""

__version__ = "0.1.0"
