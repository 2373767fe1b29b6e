"""Settings from kv_connector_extra_config and the environment (no vLLM)."""

import tempfile
import unittest
from pathlib import Path

from handoff_vllm.follower import parse_frame
from handoff_vllm.settings import SettingsError, engine_url_from_argv, load


class SettingsTest(unittest.TestCase):
    def test_extra_config_first_then_environment(self) -> None:
        s = load({"handoff_router_urls": ["http://r1:8000", "http://r2:8000"]}, "10.0.0.7", env={"HANDOFF_ROUTER_URLS": "http://ignored"}, argv=[])
        self.assertEqual(s.router_urls, ["http://r1:8000", "http://r2:8000"])
        s = load({}, "10.0.0.7", env={"HANDOFF_ROUTER_URLS": "http://r1:8000, http://r2:8000", "HANDOFF_AGENT_TOKEN": "tok"}, argv=[])
        self.assertEqual(s.router_urls, ["http://r1:8000", "http://r2:8000"])
        self.assertEqual(s.token(), "tok")
        self.assertEqual(load({}, "h", env={}, argv=[]).router_urls, [], "none: the engine runs as stock NixlConnector")

    def test_a_token_file_is_read_on_every_call(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "token"
            path.write_text("first\n")
            s = load({"handoff_token_file": str(path)}, "h", env={}, argv=[])
            self.assertEqual(s.token(), "first")
            path.write_text("rotated")
            self.assertEqual(s.token(), "rotated", "a rotated Secret takes effect without a restart")
        with self.assertRaises(SettingsError):
            load({"handoff_token_file": "/nonexistent/token"}, "h", env={}, argv=[])
        with self.assertRaises(SettingsError):
            load({"handoff_router_urls": 5}, "h", env={}, argv=[])

    def test_engine_url_from_the_api_servers_argv(self) -> None:
        argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "8100"]
        self.assertEqual(engine_url_from_argv(argv, "10.0.0.7"), "http://10.0.0.7:8100")
        self.assertEqual(engine_url_from_argv(["vllm", "serve", "m", "--host=127.0.0.1", "--port=9"], "x"), "http://127.0.0.1:9")
        self.assertEqual(engine_url_from_argv(["vllm", "serve", "m", "--host", "0.0.0.0"], "10.0.0.7"), "http://10.0.0.7:8000")
        self.assertEqual(engine_url_from_argv(["vllm", "serve", "m", "--host", "fd00::1"], "x"), "http://[fd00::1]:8000")
        explicit = load({"handoff_engine_url": "http://pod:8000"}, "h", env={}, argv=["--port", "1"])
        self.assertEqual(explicit.engine_url, "http://pod:8000")


class FrameTest(unittest.TestCase):
    def test_frames(self) -> None:
        self.assertEqual(parse_frame(["id: 3", 'data: {"seq":3,"type":"peer_gone"}']), {"seq": 3, "type": "peer_gone"})
        self.assertIsNone(parse_frame([": keep-alive"]))
        self.assertIsNone(parse_frame(["data: not json"]))
        self.assertIsNone(parse_frame(['data: {"seq":"3","type":"x"}']), "a seq must be an integer")


if __name__ == "__main__":
    unittest.main()
