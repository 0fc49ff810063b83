//! Redis Streams under faults: every client connection killed
//! (`CLIENT KILL TYPE normal`), the server stopped (SIGSTOP) past the
//! adapter's 5 s command and 10 s blocking-read timeouts, and a restart.
//! The machine's Redis keeps nothing on disk (`--save "" --appendonly
//! no`): a restart loses the stream, its consumer group and every entry in
//! it, and the guard creates them again on reconnect (`XGROUP CREATE …
//! MKSTREAM`). Entries the guard had not read by then are lost by the
//! broker and counted apart; everything the guard had read (handled, held
//! for a retry in lazaret's store, or quarantined) must finish.

use lazaret_guard::{BrokerKind, SourceSpec};
use lazaret_testkit::faults::{Service, kill_redis_clients};

use crate::battery::{self, DELIVERY_TIMEOUT, FaultBroker, TYPE};

struct Redis {
    url: String,
}

impl Redis {
    async fn conn(&self) -> Result<redis::aio::MultiplexedConnection, String> {
        redis::Client::open(self.url.as_str())
            .map_err(|e| format!("{}: {e}", self.url))?
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| format!("connect to Redis at {}: {e}", self.url))
    }
}

impl FaultBroker for Redis {
    const SERVICE: Service = Service::Redis;
    const RESTART_KEEPS: bool = false;

    async fn queue(&self, name: &str) -> String {
        // The guard creates the stream and its group (MKSTREAM).
        name.to_owned()
    }

    fn spec(&self, name: &str, queue: &str) -> SourceSpec {
        let mut spec = SourceSpec::guard(name, BrokerKind::Redis, &self.url, queue, TYPE);
        spec.delivery_timeout = DELIVERY_TIMEOUT;
        spec
    }

    async fn publish(
        &self,
        queue: &str,
        batch: &[(String, Vec<u8>)],
        confirmed: &mut dyn FnMut(usize),
    ) -> Result<(), String> {
        let mut conn = self.conn().await?;
        for (n, part) in batch.chunks(500).enumerate() {
            let mut pipe = redis::pipe();
            for (id, body) in part {
                pipe.cmd("XADD")
                    .arg(queue)
                    .arg("*")
                    .arg("body")
                    .arg(body.as_slice())
                    .arg("message_id")
                    .arg(id.as_str());
            }
            let ids: Vec<String> = pipe
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("XADD to {queue}: {e}"))?;
            for i in 0..ids.len() {
                confirmed(n * 500 + i);
            }
        }
        Ok(())
    }

    fn kill_connections(&self, _source: &str) -> Result<usize, String> {
        kill_redis_clients()
    }

    async fn remove(&self, queue: &str) {
        if let Ok(mut conn) = self.conn().await {
            let _: Result<i64, _> = redis::cmd("DEL").arg(queue).query_async(&mut conn).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_under_client_kills_a_pause_and_a_restart() {
    if !battery::enabled("redis_under_client_kills_a_pause_and_a_restart") {
        return;
    }
    let Some(url) = lazaret_testkit::service(
        "LAZARET_TEST_REDIS_URL",
        "redis://127.0.0.1:6379",
        "the Redis fault battery",
    ) else {
        return;
    };
    battery::run(&Redis { url }, "redis").await;
}
