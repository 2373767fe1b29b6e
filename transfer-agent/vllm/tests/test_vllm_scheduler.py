"""The connector's scheduler side inside vLLM's own Scheduler (needs vLLM: skipped without it).

As vLLM's connector unit tests do, a real `vllm.v1.core.sched.scheduler.Scheduler` is built
on CPU with the connector loaded by `kv_connector_module_path`, and fed model-runner outputs
by hand; no engine, no worker, no NIXL transfer. HANDOFF_TINY_MODEL names a model folder
(test/connector/follower.test.ts passes scripts/vllm-tools.sh's tiny Llama).
"""

from __future__ import annotations

import os
import socket
import unittest
from typing import Any

try:
    import vllm  # noqa: F401

    HAVE_VLLM = bool(os.environ.get("HANDOFF_TINY_MODEL"))
except ImportError:
    HAVE_VLLM = False


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@unittest.skipUnless(HAVE_VLLM, "needs vLLM and HANDOFF_TINY_MODEL (scripts/vllm-tools.sh)")
class SchedulerSideTest(unittest.TestCase):
    def scheduler(self, connector: str, role: str, extra: dict[str, Any] | None = None) -> Any:
        import torch
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        model = ModelConfig(model=os.environ["HANDOFF_TINY_MODEL"], dtype="float32", seed=0, max_model_len=1024)
        handoff = connector == "HandoffNixlConnector"
        config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(max_model_len=1024, is_encoder_decoder=False, max_num_seqs=8, max_num_batched_tokens=256),
            cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector,
                kv_connector_module_path="handoff_vllm.connector" if handoff else None,
                kv_role=role,
                kv_connector_extra_config={"kv_lease_duration": 30, **(extra or {})},
            ),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = 1000
        kv = KVCacheConfig(
            num_blocks=1000,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))],
        )
        sched = Scheduler(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config), block_size=16, log_stats=True)
        self.addCleanup(sched.connector.shutdown)
        return sched

    def request(self, rid: str, kv_params: dict[str, Any], max_tokens: int) -> Any:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id=rid, prompt_token_ids=list(range(1, 41)), sampling_params=params, pooling_params=None, block_hasher=get_request_block_hasher(16, sha256))
        req.kv_transfer_params = kv_params
        return req

    def output(self, reqs: list[Any], kv: Any = None) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        ids = [r.request_id for r in reqs]
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv,
        )

    def prefill(self, connector: str, extra: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
        """One prefill leg on a producer: scheduled, one token, finished by length."""
        sched = self.scheduler(connector, "kv_producer", extra)
        req = self.request("req-p", {"do_remote_decode": True, "do_remote_prefill": False}, max_tokens=1)
        sched.add_request(req)
        out = sched.schedule()
        engine_out = sched.update_from_output(out, self.output([req]))
        finished = [o for eco in engine_out.values() for o in eco.outputs if o.request_id == "req-p"]
        self.assertEqual(len(finished), 1)
        return sched, req, finished[0].kv_transfer_params

    def followed_prefill(self) -> tuple[Any, Any, list[int]]:
        """A prefill leg on P with the connector following a router (stopped: the test puts the
        events), and the acknowledgements it would send the router."""
        sched, _, _ = self.prefill("HandoffNixlConnector", {"handoff_router_urls": [closed_port_url()]})
        connector = sched.connector
        acks: list[int] = []
        connector._follower.stop()
        connector._follower.ack = acks.append
        return sched, connector, acks

    def test_request_finished_on_p_is_the_stock_connectors(self) -> None:
        _, _, stock = self.prefill("NixlConnector")
        sched, req, ours = self.prefill("HandoffNixlConnector")
        self.assertEqual(sorted(ours), sorted(stock), "the same kv_transfer_params for D")
        for key in ("do_remote_prefill", "remote_block_ids", "remote_request_id", "remote_host", "remote_port", "tp_size"):
            self.assertEqual(ours[key], stock[key], key)
        self.assertEqual(ours["remote_engine_id"], sched.connector.engine_id)
        self.assertIn("req-p", sched.requests, "P keeps the finished request's blocks for D")
        meta = sched.schedule().kv_connector_metadata
        self.assertIn("req-p", meta.reqs_to_send, "under a lease the worker reaps at kv_lease_duration")

    def test_events_ride_the_next_steps_metadata_and_are_acked_once_workers_confirm(self) -> None:
        from handoff_vllm.connector import HandoffWorkerMeta
        from vllm.v1.outputs import KVConnectorOutput

        sched, connector, acks = self.followed_prefill()
        # What the follower thread does with an event from the router.
        connector._inbox.put({"seq": 1, "type": "lease_release", "prefillEngineId": connector.engine_id, "requestIds": ["req-p"], "reason": "client_gone", "at": 0})
        connector._inbox.put({"seq": 2, "type": "lease_release", "prefillEngineId": "another-p", "requestIds": ["x"], "reason": "client_gone", "at": 0})
        self.assertTrue(connector.has_pending_push_work(), "the engine must step for it")
        out = sched.schedule()
        commands = out.kv_connector_metadata.handoff_commands
        self.assertEqual([(c.seq, c.kind, c.ids) for c in commands], [(1, "lease_release", ["req-p"])], "only what concerns this engine goes to the workers")
        self.assertTrue(connector.has_pending_push_work(), "until every worker confirmed")
        # The step's output: the workers applied seq 1 and released the lease (finished_sending).
        kv = KVConnectorOutput(finished_sending={"req-p"}, kv_connector_worker_meta=HandoffWorkerMeta(applied={1}))
        engine_out = sched.update_from_output(out, self.output([], kv))
        self.assertEqual(acks, [2], "seq 1 confirmed, seq 2 a no-op here: acknowledged up to 2")
        self.assertFalse(connector.has_pending_push_work())
        self.assertNotIn("req-p", sched.requests, "the scheduler freed the request's blocks")
        self.assertEqual(sched.kv_cache_manager.usage, 0.0)
        # vLLM's own path to /metrics: the step's scheduler stats carry the connector's counts.
        stats = [eco.scheduler_stats.kv_connector_stats for eco in engine_out.values() if eco.scheduler_stats]
        self.assertEqual(sum(sum(s.get("handoff_events_applied", [])) for s in stats if s), 1)

    def test_with_two_tp_ranks_the_ack_and_the_free_wait_for_both(self) -> None:
        # TP 2: each rank gets the step's metadata and applies the event on its own thread; vLLM's
        # KVOutputAggregator merges the ranks' outputs before the scheduler sees them. A real TP 2
        # engine does not fit this 2-core machine beside the others, so the ranks' outputs are
        # made by hand, as each rank's get_transfer_results and worker metadata would make them.
        from handoff_vllm.connector import HandoffWorkerMeta
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.outputs import KVConnectorOutput

        sched, connector, acks = self.followed_prefill()
        connector._inbox.put({"seq": 1, "type": "lease_release", "prefillEngineId": connector.engine_id, "requestIds": ["req-p"], "reason": "client_gone", "at": 0})
        aggregator = KVOutputAggregator(expected_finished_count=2)

        def step(*ranks: KVConnectorOutput) -> None:
            out = sched.schedule()
            outputs = [self.output([], kv) for kv in ranks]
            sched.update_from_output(out, aggregator.aggregate(outputs))

        # Both ranks got seq 1 in the same step's metadata and name it; rank 0 freed its half of
        # the lease, rank 1 reports none this step: acknowledged, the blocks still held.
        step(
            KVConnectorOutput(finished_sending={"req-p"}, kv_connector_worker_meta=HandoffWorkerMeta(applied={1})),
            KVConnectorOutput(kv_connector_worker_meta=HandoffWorkerMeta(applied={1})),
        )
        self.assertEqual(acks, [1], "acknowledged once the aggregated output confirms it")
        self.assertIn("req-p", sched.requests, "one rank's release does not free the blocks")
        self.assertFalse(connector.has_pending_push_work())
        # Rank 1's half goes (its own lease end): every rank released, the blocks are freed.
        step(KVConnectorOutput(), KVConnectorOutput(finished_sending={"req-p"}))
        self.assertNotIn("req-p", sched.requests, "freed once every rank released")
        self.assertEqual(sched.kv_cache_manager.usage, 0.0)

    def test_without_router_urls_it_is_the_stock_connector(self) -> None:
        sched, _, _ = self.prefill("HandoffNixlConnector")
        self.assertIsNone(sched.connector._inbox)
        self.assertFalse(sched.connector.has_pending_push_work())


@unittest.skipUnless(HAVE_VLLM, "needs vLLM")
class VersionTest(unittest.TestCase):
    def test_an_unsupported_vllm_is_refused_with_the_range(self) -> None:
        from unittest import mock

        import vllm
        from handoff_vllm import vllm_internals

        with mock.patch.object(vllm, "__version__", "0.40.1"):
            with self.assertRaisesRegex(vllm_internals.UnsupportedVllm, r"supports vLLM .*0\.32.* this is vLLM 0\.40\.1"):
                vllm_internals.check_version()
        self.assertTrue(vllm_internals.check_version().startswith("0.32"))


if __name__ == "__main__":
    unittest.main()
