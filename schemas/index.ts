import type { TSchema } from 'typebox'
import {
  AgentAttach,
  AgentAttached,
  AgentEvent,
  AgentEvents,
  LeaseGranted,
  LeaseRequest,
  PeerGoneRequest,
  PeerHandshake,
  PullDone,
  PullExpected,
  PullExpectation,
  PullFailed,
  PullRequest,
} from './agent-api.js'
import { AgentConfig } from './agent-config.js'
import { AgentAck, AgentRegistration, FaultToleranceEvent, LeaseReleaseEvent, PeerAliveEvent, PeerGoneEvent, RouterEvent, SnapshotEvent } from './events.js'
import { KvTransferParams } from './kv-transfer-params.js'
import {
  ChatCompletionRequest,
  ChatCompletionResponse,
  ChatMessage,
  CompletionChunk,
  CompletionRequest,
  CompletionResponse,
  ErrorBody,
  ModelList,
  TokenizeChatRequest,
  TokenizeCompletionRequest,
  TokenizeResponse,
  Usage,
} from './openai.js'
import { InstanceConfig, InstanceRole, RouterConfig } from './router-config.js'
import { KvEventsConfig } from './kv-events.js'
import { SimConfig } from './sim-config.js'

/**
 * Every shared schema, each with an `$id`. Routes reference them with `$ref`; the generator
 * writes one JSON file per entry to schemas/json/ for consumers outside TypeScript.
 */
export const sharedSchemas: readonly TSchema[] = [
  KvTransferParams,
  ChatMessage,
  ChatCompletionRequest,
  CompletionRequest,
  Usage,
  CompletionResponse,
  ChatCompletionResponse,
  CompletionChunk,
  ModelList,
  TokenizeCompletionRequest,
  TokenizeChatRequest,
  TokenizeResponse,
  ErrorBody,
  InstanceRole,
  InstanceConfig,
  RouterConfig,
  SimConfig,
  KvEventsConfig,
  AgentConfig,
  AgentAttach,
  AgentAttached,
  LeaseRequest,
  LeaseGranted,
  PullRequest,
  PullExpected,
  PullExpectation,
  PullDone,
  PullFailed,
  AgentEvent,
  AgentEvents,
  PeerHandshake,
  PeerGoneRequest,
  PeerGoneEvent,
  PeerAliveEvent,
  LeaseReleaseEvent,
  SnapshotEvent,
  RouterEvent,
  AgentRegistration,
  AgentAck,
  FaultToleranceEvent,
]

export function schemaId(schema: TSchema): string {
  const id = (schema as { $id?: unknown }).$id
  if (typeof id !== 'string') throw new Error('shared schema without $id')
  return id
}
