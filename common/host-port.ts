/** An address's host as it goes in a URL or a `host:port`: an IPv6 literal in brackets. */
export function urlHost(host: string): string {
  return host.includes(':') && !host.startsWith('[') ? `[${host}]` : host
}

/** `host:port`, the host bracketed when it is an IPv6 literal. */
export function hostPort(host: string, port: number | string): string {
  return `${urlHost(host)}:${port}`
}

/** A `host:port` (IPv6 hosts bracketed or not) split at its last colon; the host unbracketed. */
export function splitHostPort(address: string): { host: string; port: string } {
  const i = address.lastIndexOf(':')
  return { host: address.slice(0, i).replace(/^\[(.*)\]$/, '$1'), port: address.slice(i + 1) }
}
