import Type, { type Static } from 'typebox'

/**
 * vLLM's KVEventsConfig (vllm/config/kv_events.py, 0.32), as `--kv-events-config` takes it:
 * a JSON object, vLLM's defaults. `publisher` defaults to `zmq` when events are enabled.
 */
export const KvEventsConfig = Type.Object(
  {
    enable_kv_cache_events: Type.Boolean({ default: false }),
    publisher: Type.Optional(Type.Union([Type.Literal('zmq'), Type.Literal('null')])),
    // A wildcard (`*`), ipc:// or inproc:// endpoint is bound; any other is connected to.
    endpoint: Type.String({ minLength: 1, default: 'tcp://*:5557' }),
    replay_endpoint: Type.Union([Type.String({ minLength: 1 }), Type.Null()], { default: null }),
    // Batches kept for replay.
    buffer_steps: Type.Integer({ minimum: 1, default: 10_000 }),
    // The PUB socket's send high-water mark: past it, messages to a slow subscriber drop.
    hwm: Type.Integer({ minimum: 0, default: 100_000 }),
    // Events waiting to be published: past it, new ones drop.
    max_queue_size: Type.Integer({ minimum: 1, default: 100_000 }),
    topic: Type.String({ default: '' }),
  },
  { $id: 'KvEventsConfig', additionalProperties: false },
)
export type KvEventsConfig = Static<typeof KvEventsConfig>
