/**
 * A worker process for the SIGTERM tests: `node worker-process.js URL
 * GRACE_MS` runs a `node-sleep` handler until SIGTERM, then prints its
 * report as one JSON line.
 */

import { Client, Worker } from "../src/index.js";

const [url, grace] = process.argv.slice(2);
const worker = new Worker(new Client(url), { leaseMs: 3000, pollWaitMs: 500, shutdownGraceMs: Number(grace), concurrency: 1 });
worker.handle<{ ms: number }>("node-sleep", async (job) => {
  console.log(`node-sleep ${job.id}: started`);
  const until = Date.now() + job.payload.ms;
  while (Date.now() < until && !job.signal.aborted) await new Promise((r) => setTimeout(r, 20));
});
const report = await worker.run();
console.log(`stopped: ${JSON.stringify(report)}`);
// No process.exit: the worker leaves no timer behind, so the process ends
// by itself (the tests wait for that exit).
