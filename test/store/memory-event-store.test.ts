import t from 'tap'
import { ManualClock } from '../../common/clock.js'
import { MemoryEventStore } from '../../router/src/store/event-store.js'
import { eventStoreContract } from './event-store.contract.js'

// The in-memory event store (one router, nothing to install) against the store contract.
eventStoreContract(t, {
  shared: false,
  backing: async () => ({ open: async (opts) => new MemoryEventStore(opts) }),
})

t.test('an explicit id names the log', async (t) => {
  t.equal(new MemoryEventStore({ clock: new ManualClock(), id: 'fixed' }).id, 'fixed')
})
