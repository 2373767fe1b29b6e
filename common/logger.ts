import type { LoggerOptions } from 'pino'

/**
 * pino options shared by every handoff process: JSON to stdout, auth material redacted.
 * Tests pass their own destination stream and parse the lines.
 */
export function loggerOptions(opts: { level?: string; name: string }): LoggerOptions {
  return {
    name: opts.name,
    level: opts.level ?? 'info',
    redact: {
      paths: [
        'req.headers.authorization',
        'req.headers["x-api-key"]',
        'req.headers["x-admin-token"]',
        'headers.authorization',
        '*.token',
        '*.adminToken',
        '*.agentToken',
        '*.apiKeys',
        '*.apiKey',
      ],
      censor: '[redacted]',
    },
  }
}
