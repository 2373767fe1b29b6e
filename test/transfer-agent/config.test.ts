import t from 'tap'
import { agentUsage, parseAgentArgs } from '../../transfer-agent/src/config.js'

t.test('--allow-no-expiry: off by default, a flag to turn on (issue 18)', async (t) => {
  t.match(parseAgentArgs([], {}), { allowNoExpiry: false })
  t.match(parseAgentArgs(['--allow-no-expiry'], {}), { allowNoExpiry: true })
  t.throws(() => parseAgentArgs(['--allow-no-expiry', 'maybe'], {}), { code: 'XFA_ERR_INVALID_ARG' }, 'a boolean flag takes no value')
  t.match(agentUsage(), /--allow-no-expiry/)
})
