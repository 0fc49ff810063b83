/** Shared by the tests: the repository's files, and a real `lazaret serve`. */

import { spawn, type ChildProcess } from "node:child_process";
import { accessSync, constants, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync, closeSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

/** build/test/support.js -> the repository's root. */
export const REPO = fileURLToPath(new URL("../../../../", import.meta.url));
export const CASES = join(REPO, "clients", "classification-cases.json");
export const OPENAPI = join(REPO, "docs", "openapi.json");

export function loadJson(path: string): any {
  return JSON.parse(readFileSync(path, "utf8"));
}

/** Short backoffs so retried jobs come back at once. */
const CONFIG = `
[defaults]
attempts_max = 3
backoff_base_ms = 20
backoff_cap_ms = 100
`;

/**
 * `$LAZARET_BIN`, or null after a visible skip message; under CI=true a
 * missing binary fails instead of skipping.
 */
export function serverBin(): string | null {
  const path = process.env.LAZARET_BIN;
  let why: string;
  if (path) {
    try {
      accessSync(path, constants.X_OK);
      return path;
    } catch {
      why = `LAZARET_BIN=${path} is not an executable`;
    }
  } else {
    why = "LAZARET_BIN is not set";
  }
  if (process.env.CI === "true") {
    throw new Error(`${why}: these tests need the lazaret binary (cargo build -p lazaret) under CI=true`);
  }
  console.log(`SKIPPED: ${why}; the tests against a real server need the lazaret binary (set LAZARET_BIN)`);
  return null;
}

/** `lazaret serve` on a free loopback port with a temporary data directory. */
export class Server {
  readonly dir: string;
  url = "";
  private proc: ChildProcess | null = null;

  constructor(private readonly binary: string) {
    this.dir = mkdtempSync(join(tmpdir(), "lazaret-node-"));
  }

  async start(): Promise<this> {
    const cfg = join(this.dir, "lazaret.toml");
    writeFileSync(cfg, CONFIG);
    const log = openSync(join(this.dir, "server.log"), "w");
    const proc = spawn(this.binary, ["serve", "--listen", "127.0.0.1:0", "--data", join(this.dir, "data"), "--config", cfg], {
      stdio: ["ignore", "pipe", log],
    });
    closeSync(log);
    this.proc = proc;
    const lines = createInterface({ input: proc.stdout! });
    const first: string = await new Promise((resolve, reject) => {
      lines.once("line", resolve);
      proc.once("exit", (code) => reject(new Error(`lazaret serve exited (${code}) before saying where it listens`)));
    });
    const prefix = "lazaret listening on ";
    if (!first.startsWith(prefix)) throw new Error(`unexpected first line from lazaret serve: ${first}`);
    this.url = first.slice(prefix.length);
    lines.on("line", () => {}); // keep draining stdout
    return this;
  }

  async close(): Promise<void> {
    const proc = this.proc;
    if (proc && proc.exitCode === null) {
      const exited = new Promise((resolve) => proc.once("exit", resolve));
      proc.kill("SIGTERM");
      await exited;
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/**
 * Polls `check` until it returns something truthy; fails after `seconds`
 * (a bound on a broken run, not a timing assertion).
 */
export async function eventually<T>(check: () => Promise<T>, what: string, seconds = 20): Promise<NonNullable<T>> {
  const deadline = Date.now() + seconds * 1000;
  for (;;) {
    const v = await check();
    if (v) return v as NonNullable<T>;
    if (Date.now() > deadline) throw new Error(`waited ${seconds} s for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
