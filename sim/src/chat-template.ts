import type { ChatMessage } from '../../schemas/openai.js'

/**
 * A ChatML template, the shape many vLLM chat models use:
 *   <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n
 * The trailing assistant header is the generation prompt (vLLM's add_generation_prompt,
 * on by default). Both legs of a P/D request must render the same text, so this function is
 * the single place that decides it.
 */
export function renderChat(messages: readonly ChatMessage[], opts: { addGenerationPrompt?: boolean } = {}): string {
  let out = ''
  for (const m of messages) out += `<|im_start|>${m.role}\n${contentText(m.content)}<|im_end|>\n`
  if (opts.addGenerationPrompt ?? true) out += '<|im_start|>assistant\n'
  return out
}

/** OpenAI content: a string, null, or parts; only text parts reach the prompt. */
function contentText(content: ChatMessage['content']): string {
  if (typeof content === 'string') return content
  if (!Array.isArray(content)) return ''
  let out = ''
  for (const part of content) {
    const p = part as { type?: unknown; text?: unknown }
    if (p.type === 'text' && typeof p.text === 'string') out += p.text
  }
  return out
}
