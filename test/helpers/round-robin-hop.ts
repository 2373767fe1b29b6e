import { Agent, createServer, request, type IncomingMessage } from 'node:http'
import type { AddressInfo } from 'node:net'
import type { Teardown } from './cluster.js'

/*
 * One URL in front of several engines, as a Service or a load balancer puts it (issue 37 item
 * 3): each HTTP request goes to the next engine in turn. An engine that refuses the connection
 * (stopped, restarting) is skipped for that request, as a balancer leaves out an endpoint that
 * is not there; when every one refuses, 502.
 */

export interface RoundRobinHop {
  /** The URL to give the router in place of the engines'. */
  readonly url: string
  /** Requests each target answered, by index. */
  readonly served: readonly number[]
}

export async function roundRobinHop(t: Teardown, targets: readonly string[]): Promise<RoundRobinHop> {
  const agent = new Agent({ keepAlive: true })
  const served = targets.map(() => 0)
  let next = 0
  const server = createServer((req, res) => {
    const chunks: Buffer[] = []
    req.on('data', (c: Buffer) => chunks.push(c))
    req.on('end', () => {
      const body = Buffer.concat(chunks)
      const first = next
      next = (next + 1) % targets.length
      const attempt = (n: number): void => {
        if (n === targets.length) {
          res.writeHead(502).end()
          return
        }
        const i = (first + n) % targets.length
        const target = new URL(targets[i] as string)
        const up = request({ agent, host: target.hostname, port: target.port, method: req.method, path: req.url, headers: req.headers }, (answer: IncomingMessage) => {
          served[i] = (served[i] as number) + 1
          res.writeHead(answer.statusCode ?? 502, answer.headers)
          answer.pipe(res)
          answer.on('error', () => res.destroy())
        })
        // Nothing answered yet: the next engine gets the request.
        up.on('error', () => (res.headersSent ? res.destroy() : attempt(n + 1)))
        res.on('close', () => res.writableFinished || up.destroy())
        up.end(body)
      }
      attempt(0)
    })
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  t.teardown(async () => {
    server.closeAllConnections()
    agent.destroy()
    await new Promise((resolve) => server.close(resolve))
  })
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, served }
}
