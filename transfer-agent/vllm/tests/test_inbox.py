"""The inbox: what is shipped to workers, and what is acknowledged to the router (no vLLM)."""

import unittest

from handoff_vllm.inbox import Inbox, to_command


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def gone(seq: int, *ids: str) -> dict:
    return {"seq": seq, "type": "peer_gone", "engineIds": list(ids), "addresses": [], "reason": "test", "at": 0}


def release(seq: int, engine: str, *ids: str) -> dict:
    return {"seq": seq, "type": "lease_release", "prefillEngineId": engine, "requestIds": list(ids), "reason": "client_gone", "at": 0}


class InboxTest(unittest.TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.inbox = Inbox(engine_id="me", confirm_within_s=10, clock=self.clock)

    def test_ships_once_and_acks_after_every_worker_confirmed(self) -> None:
        self.inbox.put(gone(1, "p-1"))
        self.inbox.put(release(2, "me", "req-a"))
        self.assertTrue(self.inbox.busy(), "events waiting: the engine must step")
        shipped = self.inbox.ship()
        self.assertEqual([(c.seq, c.kind, c.ids) for c in shipped], [(1, "peer_gone", ["p-1"]), (2, "lease_release", ["req-a"])])
        self.assertEqual(self.inbox.ship(), [], "each event is shipped once")
        self.assertTrue(self.inbox.busy(), "shipped but not confirmed: still stepping")
        self.inbox.confirm({2})
        self.assertEqual(self.inbox.ack(), None, "acks are cumulative: 2 waits for 1")
        self.inbox.confirm({1})
        self.assertEqual(self.inbox.ack(), 2)
        self.assertEqual(self.inbox.ack(), None, "once")
        self.assertFalse(self.inbox.busy())

    def test_events_for_nobody_here_are_acknowledged_in_order_without_shipping(self) -> None:
        self.inbox.put(release(1, "another-p", "req-x"))
        self.inbox.put(gone(2, "me"))  # this engine itself: nothing for its workers
        self.inbox.put(gone(3, "p-2"))
        shipped = self.inbox.ship()
        self.assertEqual([c.seq for c in shipped], [3])
        self.assertEqual(self.inbox.expire(), [], "no-ops are not late")
        self.assertEqual(self.inbox.ack(), 2, "the no-ops before 3 are acknowledged")
        self.inbox.confirm({3})
        self.assertEqual(self.inbox.ack(), 3)

    def test_an_unconfirmed_event_stops_the_engine_stepping_after_a_while(self) -> None:
        self.inbox.put(gone(1, "p-1"))
        self.inbox.ship()
        self.clock.t = 9
        self.assertTrue(self.inbox.busy())
        self.assertEqual(self.inbox.expire(), [])
        self.assertIsNone(self.inbox.ack())
        self.clock.t = 11
        self.assertFalse(self.inbox.busy(), "a worker that never confirms must not make the engine spin")
        self.assertEqual(self.inbox.expire(), [1])
        self.assertEqual(self.inbox.ack(), 1)

    def test_a_new_log_never_gets_acks_for_the_old_one(self) -> None:
        self.inbox.put(gone(7, "p-1"))
        self.inbox.ship()
        self.inbox.new_log()
        self.inbox.put(gone(1, "p-2"))
        commands = self.inbox.ship()
        self.assertEqual([c.ids for c in commands], [["p-2"]], "the old log's event was shipped already; the new one now")
        self.inbox.confirm({7})
        self.assertEqual(self.inbox.ack(), None, "seq 7 of the old log is never acknowledged to the new one")
        self.inbox.confirm({1})
        self.assertEqual(self.inbox.ack(), 1)


class CommandTest(unittest.TestCase):
    def test_each_event_type(self) -> None:
        self.assertEqual(to_command(gone(1, "a", "me"), "me").ids, ["a"])
        self.assertIsNone(to_command(gone(1, "me"), "me"))
        snap = to_command({"seq": 4, "type": "snapshot", "goneEngineIds": ["x"], "at": 0}, "me")
        self.assertEqual((snap.kind, snap.ids), ("peer_gone", ["x"]))
        alive = to_command({"seq": 5, "type": "peer_alive", "engineIds": ["x"], "reason": "r", "at": 0}, "me")
        self.assertEqual((alive.kind, alive.ids), ("peer_alive", ["x"]))
        self.assertIsNone(to_command(release(6, "other", "r1"), "me"))
        self.assertEqual(to_command(release(6, "me", "r1"), "me").ids, ["r1"])
        self.assertIsNone(to_command({"seq": 8, "type": "from_the_future"}, "me"), "unknown types are no-ops")


if __name__ == "__main__":
    unittest.main()
