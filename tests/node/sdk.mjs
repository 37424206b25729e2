// The official OpenAI Node SDK against a running gateway: node sdk.mjs BASE_URL MODEL
// Prints one JSON object of what each call returned; tests/e2e/test_node_sdk.py checks it.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
const out = {};
const messages = [{ role: "user", content: "hello" }];

const chat = await client.chat.completions.create({ model, messages, max_tokens: 4 });
out.chat = chat.choices[0].message.content;

const stream = await client.chat.completions.create({
  model, messages, max_tokens: 5, stream: true, stream_options: { include_usage: true },
});
out.streamed = "";
for await (const chunk of stream) {
  if (chunk.choices.length) out.streamed += chunk.choices[0].delta.content ?? "";
  if (chunk.usage) out.streamedUsage = chunk.usage.completion_tokens;
}

out.models = (await client.models.list()).data.map((m) => m.id);
const card = await client.models.retrieve(model);
out.retrieved = { id: card.id, max_model_len: card.max_model_len };
try {
  await client.models.retrieve("no-such-model");
  out.missing = "found";
} catch (err) {
  out.missing = { status: err.status, code: err.code };
}

const embeddings = await client.embeddings.create({ model, input: ["a", "b"] });
out.embeddings = embeddings.data.map((d) => d.embedding.length);

const first = await client.responses.create({ model, input: "hi", max_output_tokens: 3 });
const second = await client.responses.create({
  model, input: "more", previous_response_id: first.id, max_output_tokens: 2,
});
out.responses = { text: first.output_text, follows: second.previous_response_id === first.id };
const retrieved = await client.responses.retrieve(first.id);
out.responses.retrieved = retrieved.id === first.id;

const events = await client.responses.create({
  model, input: "hi", max_output_tokens: 3, stream: true,
});
out.responseEvents = [];
for await (const event of events) out.responseEvents.push(event.type);

console.log(JSON.stringify(out));
