//! Tokens: producers read only the jobs they enqueued.

use serde_json::{Value, json};

use crate::harness::{QUICK, Server, assert_error, id_text, job};

const SHOP: &str = "tok-shop-0123456789";
const BILLING: &str = "tok-billing-0123456789";
const WORKER: &str = "tok-worker-0123456789";
const OPERATOR: &str = "tok-operator-0123456789";
const ADMIN: &str = "tok-admin-0123456789";

/// Two producers, a worker, an operator and an admin.
fn config() -> String {
    format!(
        r#"{QUICK}
[[tokens]]
name = "shop-frontend"
role = "producer"
token = "{SHOP}"

[[tokens]]
name = "billing"
role = "producer"
token = "{BILLING}"

[[tokens]]
name = "mail-worker"
role = "worker"
token = "{WORKER}"

[[tokens]]
name = "ops-alice"
role = "operator"
token = "{OPERATOR}"

[[tokens]]
name = "root-bob"
role = "admin"
token = "{ADMIN}"
"#
    )
}

async fn start() -> Server {
    Server::start(&config()).await
}

fn job_path(id: &Value) -> String {
    format!("/v1/jobs/{}", id_text(id))
}

#[tokio::test]
async fn a_producer_reads_only_the_jobs_it_enqueued() {
    let server = start().await;
    let shop = server.api_as(SHOP);
    let billing = server.api_as(BILLING);

    let mine = shop
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let r = billing
        .post(
            "/v1/jobs/batch",
            &json!({"jobs": [job("invoice", "acme", json!({"n": 2}))]}),
        )
        .await;
    let theirs = r.expect(200)["results"][0]["id"].clone();
    assert!(
        !theirs.is_null(),
        "the batch job was admitted: {}",
        r.text()
    );

    // Each producer reads its own job, single or batch enqueued…
    assert_eq!(shop.job(&mine).await["type"], "report");
    assert_eq!(billing.job(&theirs).await["type"], "invoice");
    // …and not the other's, with a reason and what to do.
    for (who, id) in [(&shop, &theirs), (&billing, &mine)] {
        let e = assert_error(&who.get(&job_path(id)).await, 403, "FORBIDDEN", None);
        let message = e["message"].as_str().unwrap_or("");
        assert!(
            message.contains("enqueued by another token")
                && message.contains("reads only the jobs it enqueued"),
            "{e}"
        );
    }
    // An unknown id is still 404, not 403.
    assert_error(&shop.get("/v1/jobs/999999").await, 404, "NOT_FOUND", None);

    // Workers, operators and admins read every job.
    for tok in [WORKER, OPERATOR, ADMIN] {
        let api = server.api_as(tok);
        assert_eq!(api.job(&mine).await["id"], mine);
        assert_eq!(api.job(&theirs).await["id"], theirs);
    }
}
