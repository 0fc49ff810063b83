/**
 * The client checked against the server's OpenAPI document
 * (docs/openapi.json): every operation it calls exists there with that
 * method, and every field of every body it sends is a property the
 * document's schema for that body names (recursively: `next`, `error`,
 * `items`, `jobs`).
 */

import assert from "node:assert/strict";
import { test } from "node:test";

import { Client, Failure, OPERATIONS, type Operation } from "../src/index.js";
import { loadJson, OPENAPI } from "./support.js";

const doc = loadJson(OPENAPI);

const LEASED = {
  id: "1", type: "t", tenant: "a", lane: "default", payload: {}, attempt: 1, idempotency_key: null,
  schema_version: null, lease_token: "9", lease_expires_at: "2026-01-01T00:00:00.000Z", created_at: "2026-01-01T00:00:00.000Z",
};

const REPLIES: Record<Operation, unknown> = {
  enqueue: { id: "1", state: "queued", admission: "ADMITTED" },
  enqueueBatch: { results: [{ id: "1", state: "queued", admission: "ADMITTED" }] },
  job: { id: "1", state: "queued" },
  cancel: { state: "cancelled" },
  lease: { jobs: [LEASED] },
  ack: { state: "succeeded", jobs: [LEASED] },
  fail: { state: "scheduled", retry_at: "2026-01-01T00:00:00.000Z", attempt: 1, jobs: [] },
  heartbeat: { lease_expires_at: "2026-01-01T00:00:00.000Z", cancel_requested: false },
  acks: { results: [{ state: "succeeded" }] },
  fails: { results: [{ state: "scheduled" }] },
};

const pattern = (template: string) => new RegExp(`^${template.replace("{id}", "[^/]+")}$`);

function operationOf(method: string, path: string): Operation | undefined {
  return (Object.keys(OPERATIONS) as Operation[]).find((op) => OPERATIONS[op][0] === method && pattern(OPERATIONS[op][1]).test(path));
}

function resolve(schema: any): any {
  while (schema && schema.$ref) schema = doc.components.schemas[schema.$ref.split("/").pop()];
  return schema;
}

/** Throws unless every key of `value` is named by `schema` (and so on down). */
function checkFields(schema: any, value: any, where: string): void {
  schema = resolve(schema);
  if (schema.anyOf) {
    if (value === null || value === undefined) return;
    const objects = schema.anyOf.map(resolve).filter((s: any) => s.properties || s.type === "object" || s.type === "array");
    assert.ok(objects.length > 0, `${where}: no schema in anyOf takes ${JSON.stringify(value)}`);
    return checkFields(objects[0], value, where);
  }
  if (value && typeof value === "object" && !Array.isArray(value) && schema.properties) {
    for (const [key, sub] of Object.entries(value)) {
      assert.ok(key in schema.properties, `${where}: field ${key} is not in the document's schema (it has ${Object.keys(schema.properties).sort()})`);
      checkFields(schema.properties[key], sub, `${where}.${key}`);
    }
    for (const key of schema.required ?? []) assert.ok(key in value, `${where}: the document requires ${key}`);
  } else if (Array.isArray(value) && schema.items) {
    value.forEach((item, i) => checkFields(schema.items, item, `${where}[${i}]`));
  }
}

test("every operation is in the document", () => {
  for (const [name, [method, template]] of Object.entries(OPERATIONS)) {
    assert.ok(doc.paths[template], `${name}: ${template} is not a path of docs/openapi.json`);
    assert.ok(doc.paths[template][method.toLowerCase()], `${name}: ${template} takes no ${method}`);
  }
});

test("every request the client sends matches the document's schema", async () => {
  const sent: Array<[string, string, unknown]> = [];
  const recorder = (async (input: string | URL | Request, init?: RequestInit) => {
    const url = new URL(String(input));
    const method = init?.method ?? "GET";
    sent.push([method, url.pathname, init?.body === undefined ? undefined : JSON.parse(String(init.body))]);
    const op = operationOf(method, url.pathname);
    assert.ok(op, `the client sent ${method} ${url.pathname}, which is not in OPERATIONS`);
    return new Response(JSON.stringify(REPLIES[op]), { status: 200 });
  }) as typeof fetch;
  const c = new Client("http://127.0.0.1:7433", { fetch: recorder });
  const next = { worker_id: "w", lanes: ["default"], types: ["t"], max_jobs: 2, lease_ms: 30000, wait_ms: 100 };
  const failure = Failure.deferred("http_429", "m", 10).withTraceback("tb");
  await c.enqueue({ type: "t", tenant: "a", payload: { x: 1 }, lane: "l", idempotency_key: "k", schema_version: 1, delay_ms: 5, traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" });
  await c.enqueueBatch([{ type: "t", tenant: "a", payload: 1, lane: "l", idempotency_key: "k", schema_version: 2, delay_ms: 3, traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" }, { type: "t", tenant: "b", payload: null }]);
  await c.job("1");
  await c.cancel("1");
  await c.lease(next);
  await c.ack("1", "9", next);
  await c.fail("1", "9", failure, next);
  await c.heartbeat("1", "9", 1000);
  await c.acks([["1", "9"]]);
  await c.fails([["1", "9", failure]]);
  const called = new Set<Operation>();
  for (const [method, path, body] of sent) {
    const op = operationOf(method, path)!;
    called.add(op);
    const spec = doc.paths[OPERATIONS[op][1]][method.toLowerCase()];
    if (body === undefined) {
      assert.equal(spec.requestBody, undefined, `${method} ${path} sent no body`);
      continue;
    }
    checkFields(spec.requestBody.content["application/json"].schema, body, `${method} ${OPERATIONS[op][1]}`);
  }
  assert.deepEqual([...called].sort(), (Object.keys(OPERATIONS) as Operation[]).sort(), "every operation is exercised");
});

test("the check sees a field the document does not name", () => {
  const lease = doc.paths["/v1/leases"].post.requestBody.content["application/json"].schema;
  assert.throws(() => checkFields(lease, { worker_id: "w", max_job: 1 }, "lease"));
  const fail = doc.paths["/v1/jobs/{id}/fail"].post.requestBody.content["application/json"].schema;
  assert.throws(() => checkFields(fail, { lease_token: "1", error: { klass: "x" } }, "fail"));
});
