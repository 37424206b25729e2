// The official OpenAI Node SDK against a running gateway: node sdk.mjs BASE_URL MODEL
// Prints one JSON object of what each call returned; tests/e2e/test_node_sdk.py checks it.
import OpenAI, { toFile } from "openai";

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

// A batch: the input uploaded as the SDK uploads files, run, its output read back.
const line = (i) => JSON.stringify({
  custom_id: `n${i}`, method: "POST", url: "/v1/chat/completions",
  body: { model, messages, max_tokens: 2 },
});
const input = [0, 1, 2].map(line).join("\n") + "\n";
const file = await client.files.create({
  file: await toFile(Buffer.from(input), "in.jsonl"), purpose: "batch",
});
const batch = await client.batches.create({
  input_file_id: file.id, endpoint: "/v1/chat/completions", completion_window: "24h",
});
let done = batch;
const ended = ["completed", "failed", "expired", "cancelled"];
for (let i = 0; i < 300 && !ended.includes(done.status); i++) {
  await new Promise((resolve) => setTimeout(resolve, 100));
  done = await client.batches.retrieve(batch.id);
}
const output = await (await client.files.content(done.output_file_id)).text();
out.batch = {
  status: done.status, completed: done.request_counts.completed,
  ids: output.trim().split("\n").map((l) => JSON.parse(l).custom_id).sort(),
  listed: (await client.batches.list()).data.some((b) => b.id === batch.id),
  file: (await client.files.retrieve(file.id)).bytes === Buffer.byteLength(input),
};

console.log(JSON.stringify(out));
