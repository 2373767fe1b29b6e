import t from 'tap'
import { answerProof, checkHandshake, NonceWindow, PEER_AUTH_SCHEME, peerKey, proveHandshake, sameProof, WINDOW_MS, type HandshakeClaim } from '../../transfer-agent/src/peer-proof.js'

// The peer plane's proofs (issue 18 §2), on a clock of the test's: what the callee accepts.
const key = peerKey('a-peer-secret-of-16+')
const NOW = 1_800_000_000_000
const claim: HandshakeClaim = { callee: 'p-1', address: '10.0.0.5:7400', caller: 'agent-d', ts: NOW, nonce: 'ab'.repeat(16) }
const query = (c: HandshakeClaim) => ({ engine_id: c.callee, caller: c.caller, ts: String(c.ts), nonce: c.nonce })
const header = (c: HandshakeClaim, k = key) => `${PEER_AUTH_SCHEME} ${proveHandshake(k, c)}`

t.test('a proof is good once, at the address it names, within the window', async (t) => {
  const nonces = new NonceWindow()
  t.equal(checkHandshake(key, '10.0.0.5:7400', query(claim), header(claim), NOW + 10, nonces), 'ok')
  t.equal(checkHandshake(key, '10.0.0.5:7400', query(claim), header(claim), NOW + 20, nonces), 'replayed', 'the same nonce again')
  const other = { ...claim, nonce: 'cd'.repeat(16) }
  t.equal(checkHandshake(key, '10.0.0.6:7400', query(other), header(other), NOW, nonces), 'bad_proof', 'made for another address')
  t.equal(checkHandshake(key, '10.0.0.5:7401', query(other), header(other), NOW, nonces), 'bad_proof', 'another port')
  t.equal(checkHandshake(key, '10.0.0.5:7400', query(other), header(other, peerKey('another-secret-xxxxx')), NOW, nonces), 'bad_proof', 'another key')
  t.equal(checkHandshake(key, '10.0.0.5:7400', { ...query(other), caller: 'agent-x' }, header(other), NOW, nonces), 'bad_proof', 'a field changed')
  t.equal(checkHandshake(key, '10.0.0.5:7400', query(other), header(other), NOW + WINDOW_MS + 1, nonces), 'stale', 'too late')
  t.equal(checkHandshake(key, '10.0.0.5:7400', query(other), undefined, NOW, nonces), 'missing')
  t.equal(checkHandshake(key, '10.0.0.5:7400', query(other), `Bearer ${proveHandshake(key, other)}`, NOW, nonces), 'missing', 'another scheme')
  t.equal(checkHandshake(key, '10.0.0.5:7400', { ...query(other), nonce: 'short' }, header(other), NOW, nonces), 'bad_proof')
})

t.test('addresses compare however the host was written', async (t) => {
  const nonces = new NonceWindow()
  const v6 = { ...claim, address: '[FD00::5]:7400' }
  t.equal(checkHandshake(key, 'fd00::5:7400', query(v6), header(v6), NOW, nonces), 'ok')
  const upper = { ...claim, address: 'P-0.Example:7400', nonce: 'ef'.repeat(16) }
  t.equal(checkHandshake(key, 'p-0.example:7400', query(upper), header(upper), NOW, nonces), 'ok')
})

t.test('the nonce window is bounded', async (t) => {
  const nonces = new NonceWindow(100)
  let refused = 0
  for (let i = 0; i < 1000; i++) if (!nonces.fresh(`n${i}`, NOW + i)) refused++
  t.equal(refused, 0, '1,000 distinct nonces are fresh')
  t.ok(nonces.fresh('n0', NOW + 1000), 'the oldest went first')
  t.notOk(nonces.fresh('n999', NOW + 1001), 'a recent one is remembered')
})

t.test('an answer proof covers the body and the request’s nonce', async (t) => {
  const p = answerProof(key, claim.nonce, '{"engineId":"p-1"}')
  t.ok(sameProof(p, answerProof(key, claim.nonce, Buffer.from('{"engineId":"p-1"}'))))
  t.notOk(sameProof(p, answerProof(key, claim.nonce, '{"engineId":"p-2"}')), 'another body')
  t.notOk(sameProof(p, answerProof(key, 'cd'.repeat(16), '{"engineId":"p-1"}')), 'another nonce')
  t.notOk(sameProof(p, undefined))
  t.notOk(sameProof(p, 'zz'))
})
