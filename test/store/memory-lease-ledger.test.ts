import t from 'tap'
import { MemoryLeaseLedger } from '../../router/src/leases/memory-ledger.js'
import { leaseLedgerContract } from './lease-ledger.contract.js'

// The in-memory lease ledger (one router) against the ledger contract.
leaseLedgerContract(t, { open: async (_t, opts) => new MemoryLeaseLedger(opts) })
