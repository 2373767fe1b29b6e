import type { Logger, LoggerOptions } from 'pino'

/** What a request log line says of the request (fastify logs `{req}` on each one). */
interface LoggedRequest {
  method: string
  url: string
  host?: string
  ip?: string
  socket?: { remotePort?: number }
}

/**
 * The URL without its query string: clients put keys and tokens there (`?api_key=…`), and a
 * query is never needed to read a log. Its presence is kept as `?[redacted]` (issue 18).
 */
export function redactQuery(url: string): string {
  const q = url.indexOf('?')
  return q < 0 ? url : `${url.slice(0, q)}?[redacted]`
}

/** Serializers every handoff logger carries; fastify's own `req` one logs the whole URL. */
export const requestSerializers = {
  req: (req: LoggedRequest) => ({
    method: req.method,
    url: redactQuery(req.url),
    host: req.host,
    remoteAddress: req.ip,
    remotePort: req.socket?.remotePort,
  }),
}

/**
 * The logger a fastify app is given: `logger` with the request serializers on top, so a
 * logger built elsewhere (a test's sink) logs requests the same way as loggerOptions' own.
 */
export function withRequestSerializers(logger: Logger): Logger {
  return logger.child({}, { serializers: requestSerializers })
}

/**
 * pino options shared by every handoff process: JSON to stdout, auth material redacted.
 * Tests pass their own destination stream and parse the lines.
 */
export function loggerOptions(opts: { level?: string; name: string }): LoggerOptions {
  return {
    name: opts.name,
    level: opts.level ?? 'info',
    serializers: requestSerializers,
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
