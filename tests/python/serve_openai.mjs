// serve_openai.mjs — the official OpenAI Node SDK against `kvrope-llama serve`
// (driven by tests/python/test_serve.py, which installs the pinned `openai`
// package into $KVR_OPENAI and sets KVR_SERVE_URL). Prints one JSON line of
// what it saw; the Python side asserts on it.
import { createRequire } from "node:module";
import path from "node:path";

const require = createRequire(path.join(process.env.KVR_OPENAI, "node_modules", "x.js"));
const OpenAI = require("openai");

const client = new OpenAI({ baseURL: process.env.KVR_SERVE_URL, apiKey: "none" });
const prompt = "def count_words(lines):\n    total = 0\n";
const messages = [{ role: "user", content: "count the words in a file" }];

const completion = await client.completions.create({
  model: "kvrope-code.gguf", prompt, max_tokens: 6, temperature: 0,
});
let streamText = "";
const stream = await client.completions.create({
  model: "kvrope-code.gguf", prompt, max_tokens: 6, temperature: 0, stream: true,
});
for await (const part of stream) streamText += part.choices[0]?.text ?? "";

const chat = await client.chat.completions.create({
  model: "kvrope-code.gguf", messages, max_tokens: 6, temperature: 0,
});
let chatStreamText = "";
let chatUsage = null;
const chatStream = await client.chat.completions.create({
  model: "kvrope-code.gguf", messages, max_tokens: 6, temperature: 0, stream: true,
  stream_options: { include_usage: true },
});
for await (const part of chatStream) {
  if (part.choices.length) chatStreamText += part.choices[0].delta?.content ?? "";
  if (part.usage) chatUsage = part.usage;
}
const models = [];
for await (const m of client.models.list()) models.push(m.id);

console.log(JSON.stringify({
  completion: { text: completion.choices[0].text, usage: completion.usage },
  stream_text: streamText,
  chat: chat.choices[0].message,
  chat_stream_text: chatStreamText,
  chat_usage: chatUsage,
  models,
}));
