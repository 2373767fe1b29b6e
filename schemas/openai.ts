import Type, { type Static } from 'typebox'

/*
 * OpenAI-compatible request and response bodies, as far as handoff reads or writes them.
 * Requests are passthrough (`additionalProperties: true`): the router forwards every field it
 * does not touch, so sampling options reach the engines unchanged.
 */

/** Engine-to-engine handoff parameters; see kv-transfer-params.ts for the fields. */
const KvTransferParamsField = Type.Optional(Type.Union([Type.Ref('KvTransferParams'), Type.Null()]))

const NullableInt = (min: number) => Type.Optional(Type.Union([Type.Integer({ minimum: min }), Type.Null()]))

export const ChatMessage = Type.Object(
  {
    role: Type.String({ minLength: 1 }),
    // A string, an array of content parts, or null (assistant tool calls).
    content: Type.Optional(Type.Union([Type.String(), Type.Array(Type.Object({}, { additionalProperties: true })), Type.Null()])),
  },
  { $id: 'ChatMessage', additionalProperties: true },
)
export type ChatMessage = Static<typeof ChatMessage>

const CommonRequestFields = {
  model: Type.String({ minLength: 1 }),
  stream: Type.Optional(Type.Union([Type.Boolean(), Type.Null()])),
  stream_options: Type.Optional(Type.Union([Type.Object({}, { additionalProperties: true }), Type.Null()])),
  max_tokens: NullableInt(1),
  min_tokens: NullableInt(0),
  // Choices per prompt. vLLM's decoder reads the prompt's KV once per choice, so the router
  // runs n > 1 as n handoffs of one choice each (one lease each).
  n: NullableInt(1),
  kv_transfer_params: KvTransferParamsField,
}

export const ChatCompletionRequest = Type.Object(
  {
    ...CommonRequestFields,
    messages: Type.Array(Type.Ref('ChatMessage'), { minItems: 1 }),
    max_completion_tokens: NullableInt(1),
    min_completion_tokens: NullableInt(0),
  },
  { $id: 'ChatCompletionRequest', additionalProperties: true },
)
export type ChatCompletionRequest = Static<typeof ChatCompletionRequest> & {
  messages: ChatMessage[]
  kv_transfer_params?: Record<string, unknown> | null
}

export const CompletionRequest = Type.Object(
  {
    ...CommonRequestFields,
    // OpenAI allows a string, strings, token ids or lists of token ids.
    prompt: Type.Union([
      Type.String(),
      Type.Array(Type.String(), { minItems: 1 }),
      Type.Array(Type.Integer({ minimum: 0 }), { minItems: 1 }),
      Type.Array(Type.Array(Type.Integer({ minimum: 0 }), { minItems: 1 }), { minItems: 1 }),
    ]),
  },
  { $id: 'CompletionRequest', additionalProperties: true },
)
export type CompletionRequest = Static<typeof CompletionRequest> & {
  kv_transfer_params?: Record<string, unknown> | null
}

export const Usage = Type.Object(
  {
    prompt_tokens: Type.Integer({ minimum: 0 }),
    completion_tokens: Type.Integer({ minimum: 0 }),
    total_tokens: Type.Integer({ minimum: 0 }),
    // vLLM's --enable-prompt-tokens-details: prompt tokens found in the engine's prefix cache.
    prompt_tokens_details: Type.Optional(Type.Union([Type.Object({ cached_tokens: Type.Integer({ minimum: 0 }) }, { additionalProperties: true }), Type.Null()])),
  },
  { $id: 'Usage', additionalProperties: true },
)
export type Usage = Static<typeof Usage>

const FinishReason = Type.Union([Type.String(), Type.Null()])

export const CompletionResponse = Type.Object(
  {
    id: Type.String(),
    object: Type.Literal('text_completion'),
    created: Type.Integer(),
    model: Type.String(),
    choices: Type.Array(
      Type.Object(
        {
          index: Type.Integer({ minimum: 0 }),
          text: Type.String(),
          logprobs: Type.Union([Type.Object({}, { additionalProperties: true }), Type.Null()]),
          finish_reason: FinishReason,
        },
        { additionalProperties: true },
      ),
    ),
    usage: Type.Optional(Type.Union([Type.Ref('Usage'), Type.Null()])),
    kv_transfer_params: KvTransferParamsField,
  },
  { $id: 'CompletionResponse', additionalProperties: true },
)
export type CompletionResponse = Static<typeof CompletionResponse> & {
  usage?: Usage | null
  kv_transfer_params?: Record<string, unknown> | null
}

export const ChatCompletionResponse = Type.Object(
  {
    id: Type.String(),
    object: Type.Literal('chat.completion'),
    created: Type.Integer(),
    model: Type.String(),
    choices: Type.Array(
      Type.Object(
        {
          index: Type.Integer({ minimum: 0 }),
          message: Type.Object(
            { role: Type.String(), content: Type.Union([Type.String(), Type.Null()]) },
            { additionalProperties: true },
          ),
          logprobs: Type.Union([Type.Object({}, { additionalProperties: true }), Type.Null()]),
          finish_reason: FinishReason,
        },
        { additionalProperties: true },
      ),
    ),
    usage: Type.Optional(Type.Union([Type.Ref('Usage'), Type.Null()])),
    kv_transfer_params: KvTransferParamsField,
  },
  { $id: 'ChatCompletionResponse', additionalProperties: true },
)
export type ChatCompletionResponse = Static<typeof ChatCompletionResponse> & {
  usage?: Usage | null
  kv_transfer_params?: Record<string, unknown> | null
}

/** One SSE `data:` frame of a streamed completion (text or chat). */
export const CompletionChunk = Type.Object(
  {
    id: Type.String(),
    object: Type.Union([Type.Literal('text_completion'), Type.Literal('chat.completion.chunk')]),
    created: Type.Integer(),
    model: Type.String(),
    choices: Type.Array(Type.Object({ index: Type.Integer({ minimum: 0 }) }, { additionalProperties: true })),
    usage: Type.Optional(Type.Union([Type.Ref('Usage'), Type.Null()])),
  },
  { $id: 'CompletionChunk', additionalProperties: true },
)
export type CompletionChunk = Static<typeof CompletionChunk>

export const ModelList = Type.Object(
  {
    object: Type.Literal('list'),
    data: Type.Array(
      Type.Object(
        { id: Type.String(), object: Type.Literal('model'), created: Type.Integer(), owned_by: Type.String() },
        { additionalProperties: true },
      ),
    ),
  },
  { $id: 'ModelList', additionalProperties: true },
)
export type ModelList = Static<typeof ModelList>

/**
 * vLLM's `POST /tokenize` (vllm/entrypoints/serve/tokenize/protocol.py): the prompt's token ids
 * as the engine sees them, its chat template applied. The router asks it for prefix-aware
 * routing (docs/routing.md); the simulator serves it as vLLM does. The defaults are each
 * endpoint's own: special tokens added for a completion prompt, not for a chat.
 */
export const TokenizeCompletionRequest = Type.Object(
  {
    model: Type.Optional(Type.Union([Type.String(), Type.Null()])),
    prompt: Type.String(),
    add_special_tokens: Type.Optional(Type.Boolean()),
    return_token_strs: Type.Optional(Type.Union([Type.Boolean(), Type.Null()])),
  },
  { $id: 'TokenizeCompletionRequest', additionalProperties: true },
)
export type TokenizeCompletionRequest = Static<typeof TokenizeCompletionRequest>

export const TokenizeChatRequest = Type.Object(
  {
    model: Type.Optional(Type.Union([Type.String(), Type.Null()])),
    messages: Type.Array(Type.Ref('ChatMessage')),
    add_generation_prompt: Type.Optional(Type.Boolean()),
    continue_final_message: Type.Optional(Type.Boolean()),
    add_special_tokens: Type.Optional(Type.Boolean()),
    return_token_strs: Type.Optional(Type.Union([Type.Boolean(), Type.Null()])),
  },
  { $id: 'TokenizeChatRequest', additionalProperties: true },
)
export type TokenizeChatRequest = Static<typeof TokenizeChatRequest> & { messages: ChatMessage[] }

export const TokenizeResponse = Type.Object(
  {
    count: Type.Integer({ minimum: 0 }),
    max_model_len: Type.Integer({ minimum: 0 }),
    tokens: Type.Array(Type.Integer({ minimum: 0 })),
    token_strs: Type.Optional(Type.Union([Type.Array(Type.String()), Type.Null()])),
  },
  { $id: 'TokenizeResponse', additionalProperties: true },
)
export type TokenizeResponse = Static<typeof TokenizeResponse>

/**
 * OpenAI's error body. `code` is handoff's stable error code (RTR_ERR_*), the thing clients
 * branch on; `type` is OpenAI's coarse class.
 */
export const ErrorBody = Type.Object(
  {
    error: Type.Object(
      {
        message: Type.String(),
        type: Type.String(),
        param: Type.Union([Type.String(), Type.Null()]),
        code: Type.Union([Type.String(), Type.Null()]),
      },
      { additionalProperties: false },
    ),
  },
  { $id: 'ErrorBody', additionalProperties: false },
)
export type ErrorBody = Static<typeof ErrorBody>
