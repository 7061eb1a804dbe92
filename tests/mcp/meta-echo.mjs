// A minimal MCP server over stdio (newline-delimited JSON-RPC, no dependencies) for agentd's
// tests: one tool, `whoami`, answers with the `_meta` of the request that called it, so a test
// can see whom agentd says the call acts for.
import { createInterface } from "node:readline";

const send = (msg) => process.stdout.write(JSON.stringify({ jsonrpc: "2.0", ...msg }) + "\n");

createInterface({ input: process.stdin }).on("line", (line) => {
  let req;
  try {
    req = JSON.parse(line);
  } catch {
    return;
  }
  if (req.id === undefined) return; // a notification
  const { id, method, params } = req;
  if (method === "initialize") {
    send({
      id,
      result: {
        protocolVersion: "2025-06-18",
        capabilities: { tools: {} },
        serverInfo: { name: "meta-echo", version: "1.0.0" },
      },
    });
  } else if (method === "tools/list") {
    send({
      id,
      result: {
        tools: [
          {
            name: "whoami",
            description: "Answers with the request's _meta.",
            inputSchema: { type: "object", properties: {} },
          },
        ],
      },
    });
  } else if (method === "tools/call") {
    const meta = (params && params._meta) || null;
    send({ id, result: { content: [{ type: "text", text: JSON.stringify(meta) }] } });
  } else if (method === "ping") {
    send({ id, result: {} });
  } else {
    send({ id, error: { code: -32601, message: `no method ${method}` } });
  }
});
