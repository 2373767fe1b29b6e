import { flagsOf, flagUsage, kebab, parseFlags } from '../../common/schema-flags.js'
import { createAjv, describeErrors } from '../../schemas/ajv.js'
import { AgentConfig } from '../../schemas/agent-config.js'
import { xfaError } from './errors.js'

/*
 * `handoff agent` flags → a validated, frozen AgentConfig. Environment: HANDOFF_AGENT_TOKEN and
 * HANDOFF_PEER_SECRET (so secrets stay out of `ps`) and NIXL_LIB_DIR, each overridden by its flag. The test
 * switch `--unsafe-skip-deadline-checks` is refused unless HANDOFF_ALLOW_UNSAFE=1 is set too,
 * so no production command line can turn the lease checks off by accident.
 */

const FLAGS = flagsOf(AgentConfig, ['unsafeSkipDeadlineChecks'])
const ALL_FLAGS = flagsOf(AgentConfig)

export function agentUsage(): string {
  return [
    'usage: handoff agent [options]',
    '',
    "A transfer agent: moves its engine's KV blocks with NIXL under leases (docs/transfer-agent.md).",
    '',
    'options:',
    ...flagUsage(FLAGS),
    '  --help                         this text',
    '',
  ].join('\n')
}

export function parseAgentArgs(argv: readonly string[], env: NodeJS.ProcessEnv = process.env): Readonly<AgentConfig> | 'help' {
  let raw: Record<string, unknown> | 'help'
  try {
    raw = parseFlags(ALL_FLAGS, argv)
  } catch (err) {
    throw xfaError('XFA_ERR_INVALID_ARG', (err as Error).message)
  }
  if (raw === 'help') return 'help'
  if (raw.unsafeSkipDeadlineChecks === true && env.HANDOFF_ALLOW_UNSAFE !== '1') {
    throw xfaError('XFA_ERR_INVALID_ARG', '--unsafe-skip-deadline-checks is a test switch: it needs HANDOFF_ALLOW_UNSAFE=1')
  }
  if (raw.agentToken === undefined && env.HANDOFF_AGENT_TOKEN) raw.agentToken = env.HANDOFF_AGENT_TOKEN
  if (raw.peerSecret === undefined && env.HANDOFF_PEER_SECRET) raw.peerSecret = env.HANDOFF_PEER_SECRET
  if (raw.nixlLibDir === undefined && env.NIXL_LIB_DIR) raw.nixlLibDir = env.NIXL_LIB_DIR
  return validateAgentConfig(raw)
}

export function validateAgentConfig(raw: Record<string, unknown>): Readonly<AgentConfig> {
  const validate = createAjv({ verbose: true }).getSchema<AgentConfig>('AgentConfig')
  if (!validate) throw new Error('AgentConfig schema not registered')
  const copy = structuredClone(raw)
  if (!validate(copy)) {
    const message = describeErrors(validate.errors).replace(/\/([A-Za-z]+)/g, (m, key: string) => (ALL_FLAGS.some((f) => f.key === key) ? `--${kebab(key)}` : m))
    throw xfaError('XFA_ERR_INVALID_ARG', message)
  }
  return Object.freeze(copy as AgentConfig)
}
