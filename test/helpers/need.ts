const ci = process.env.CI === 'true' || process.env.CI === '1'

/**
 * What a `need…` helper returns for tap's `skip` once it knows a tool is missing: the reason,
 * so the test is skipped and says what to install, or, under CI, a failure and false. CI
 * installs everything; there a missing tool is a defect, never a skip.
 */
export function missing(t: { fail(message: string): void }, reason: string): string | false {
  if (!ci) return reason
  t.fail(`${reason}; CI=true requires it`)
  return false
}
