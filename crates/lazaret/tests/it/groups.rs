//! Failure groups (issue 30): dead letters whose errors differ only by data
//! share a group, which is listed, archived, restored, redriven and purged
//! as one; a redrive's report follows its jobs.

use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, TOKENS, assert_error, cli, id_text, job, lease_req};

/// Enqueues a job, leases it and fails it permanently with `message`;
/// returns its job id.
async fn dead_letter(api: &Api, job_type: &str, tenant: &str, message: &str) -> Value {
    let id = api.enqueue_ok(&job(job_type, tenant, json!({}))).await;
    let mut req = lease_req("w-groups", 1, 30_000);
    req["types"] = json!([job_type]);
    let leased = api.lease_one(&req).await;
    assert_eq!(leased["id"], id);
    let error = json!({"class": "permanent", "kind": "bad_input", "message": message});
    let r = api.fail(&id, &leased["lease_token"], error).await;
    assert_eq!(r.expect(200)["state"], "dead_lettered");
    id
}

async fn groups(api: &Api, query: &str) -> Value {
    api.get(&format!("/v1/dead-letters/groups?{query}"))
        .await
        .expect(200)
        .clone()
}

#[tokio::test]
async fn a_group_is_listed_archived_restored_redriven_and_reported_as_one() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let j1 = dead_letter(&api, "report", "acme", "order 17 failed for 'bob'").await;
    let j2 = dead_letter(&api, "report", "globex", "order 90211 failed for 'carol'").await;
    dead_letter(&api, "report", "acme", "cannot open /var/data/17.csv").await;

    // The contract's fields.
    let body = groups(&api, "").await;
    let items = body["items"].as_array().expect("items");
    assert_eq!(items.len(), 2, "{body}");
    assert_eq!(body["next_cursor"], Value::Null);
    assert!(
        items
            .iter()
            .any(|g| g["fingerprint"] == "cannot open <path>" && g["count"] == 1),
        "{body}"
    );
    let g = items
        .iter()
        .find(|g| g["count"] == 2)
        .unwrap_or_else(|| panic!("no group of two in {body}"));
    for field in [
        "id",
        "count",
        "type",
        "reason",
        "kind",
        "fingerprint",
        "sample_error",
        "first_at",
        "last_at",
        "tenants",
        "sources",
    ] {
        assert!(g.get(field).is_some(), "no {field} in {g}");
    }
    assert_eq!(g["count"], 2);
    assert_eq!(g["type"], "report");
    assert_eq!(g["reason"], "permanent");
    assert_eq!(g["kind"], "bad_input");
    assert_eq!(g["fingerprint"], "order <n> failed for <q>");
    assert_eq!(g["sample_error"], "order 90211 failed for 'carol'");
    assert_eq!(g["tenants"], json!(["acme", "globex"]));
    assert_eq!(g["sources"], json!([]));
    assert_eq!(g["rate_1h"], 2);
    let group = g["id"].as_str().expect("a string id").to_owned();
    let d1 = api.dead_letter_of(&j1).await;
    assert_eq!(
        d1["group_id"],
        group.as_str(),
        "a dead letter names its group"
    );

    // Pages of one, by cursor, in the order of the whole list.
    let first = groups(&api, "limit=1").await;
    let cursor = first["next_cursor"].as_str().expect("a cursor").to_owned();
    let second = groups(&api, &format!("limit=1&cursor={cursor}")).await;
    assert_eq!(
        (
            first["items"][0]["id"].clone(),
            second["items"][0]["id"].clone()
        ),
        (items[0]["id"].clone(), items[1]["id"].clone())
    );
    assert_eq!(second["next_cursor"], Value::Null);
    // Filters.
    assert_eq!(
        groups(&api, "tenant=globex").await["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(groups(&api, "type=other").await["items"], json!([]));
    assert_error(
        &api.get("/v1/dead-letters/groups?colour=red").await,
        400,
        "BAD_REQUEST",
        None,
    );

    // Archive the group: a dry run first, then for real.
    let by_group = json!({"filter": {"group": group}});
    let mut dry = by_group.clone();
    dry["dry_run"] = json!(true);
    let r = api.post("/v1/dead-letters/archive", &dry).await;
    let body = r.expect(200);
    assert_eq!(
        (body["matched"].clone(), body["archived"].clone()),
        (json!(2), json!(0)),
        "{body}"
    );
    assert_eq!(
        api.dead_letters("").await.len(),
        3,
        "a dry run changes nothing"
    );
    let r = api.post("/v1/dead-letters/archive", &by_group).await;
    assert_eq!(r.expect(200)["archived"], 2);
    assert_eq!(api.dead_letters("").await.len(), 1, "hidden from the list");
    assert_eq!(api.dead_letters("archived=true").await.len(), 2);
    assert_eq!(groups(&api, "").await["items"].as_array().unwrap().len(), 1);
    assert_eq!(
        groups(&api, "archived=true").await["items"][0]["id"],
        group.as_str()
    );
    let reasons = api
        .get("/v1/dead-letters/reasons")
        .await
        .expect(200)
        .clone();
    assert_eq!(reasons["reasons"][0]["count"], 1, "{reasons}");

    // Restore by id: an unknown (or active) id is named, not counted.
    let d2 = api
        .dead_letters("archived=true")
        .await
        .into_iter()
        .find(|d| d["job_id"] == j2)
        .expect("archived");
    let r = api
        .post(
            "/v1/dead-letters/restore",
            &json!({"ids": [id_text(&d1["id"]), id_text(&d2["id"]), "987654321"]}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["restored"], 2, "{body}");
    assert_eq!(body["not_found"], json!(["987654321"]));
    assert_eq!(api.dead_letters("").await.len(), 3);
    let audit = api
        .get("/v1/audit?action=archive")
        .await
        .expect(200)
        .clone();
    assert_eq!(audit["items"][0]["count"], 2, "{audit}");
    let audit = api
        .get("/v1/audit?action=restore")
        .await
        .expect(200)
        .clone();
    assert_eq!(audit["items"][0]["count"], 2, "{audit}");

    // Redrive the group; its report follows the jobs.
    let r = api.post("/v1/dead-letters/redrive", &by_group).await;
    let body = r.expect(200).clone();
    assert_eq!(body["redriven"], 2, "{body}");
    let redrive = body["redrive_id"]
        .as_str()
        .expect("a redrive id")
        .to_owned();
    let report = |api: &Api| {
        let path = format!("/v1/redrives/{redrive}");
        let api = api.clone();
        async move { api.get(&path).await.expect(200).clone() }
    };
    let r = report(&api).await;
    assert_eq!(r["id"], redrive.as_str());
    assert_eq!(
        (
            r["sent"].clone(),
            r["running"].clone(),
            r["succeeded"].clone(),
            r["failed_again"].clone()
        ),
        (json!(2), json!(2), json!(0), json!(0)),
        "{r}"
    );
    assert_eq!(r["from_groups"], json!([{"group": group, "count": 2}]));

    let mut req = lease_req("w-groups", 1, 30_000);
    req["types"] = json!(["report"]);
    let one = api.lease_one(&req).await;
    api.ack(&one["id"], &one["lease_token"]).await.expect(200);
    let r = report(&api).await;
    assert_eq!(
        (r["running"].clone(), r["succeeded"].clone()),
        (json!(1), json!(1)),
        "{r}"
    );

    let other = api.lease_one(&req).await;
    let error = json!({"class": "permanent", "kind": "timeout", "message": "upstream gone"});
    api.fail(&other["id"], &other["lease_token"], error)
        .await
        .expect(200);
    let r = report(&api).await;
    assert_eq!(
        (
            r["running"].clone(),
            r["succeeded"].clone(),
            r["failed_again"].clone()
        ),
        (json!(0), json!(1), json!(1)),
        "{r}"
    );
    let again = api.dead_letter_of(&other["id"]).await;
    assert_eq!(
        r["failed_again_groups"],
        json!([{"group": again["group_id"], "count": 1}])
    );
    assert_ne!(again["group_id"], group.as_str());
    assert_error(
        &api.get("/v1/redrives/no-such-redrive").await,
        404,
        "NOT_FOUND",
        None,
    );

    // Purge by group.
    let r = api
        .post(
            "/v1/dead-letters/purge",
            &json!({"filter": {"group": again["group_id"]}, "confirm": true}),
        )
        .await;
    assert_eq!(r.expect(200)["purged"], 1);

    // The CLI lists the groups.
    let out = cli(&server, &["dlq", "groups"]).await;
    assert!(out.contains("cannot open <path>"), "{out}");
}

#[tokio::test]
async fn archive_and_restore_need_the_operator_role_and_reading_groups_the_read_role() {
    let server = Server::start(&format!("{QUICK}\n{TOKENS}")).await;
    let producer = server.api_as("producer-secret");
    let operator = server.api_as("operator-secret");
    let body = json!({"ids": ["1"]});
    for path in ["/v1/dead-letters/archive", "/v1/dead-letters/restore"] {
        assert_error(&producer.post(path, &body).await, 403, "FORBIDDEN", None);
        operator.post(path, &body).await.expect(200);
    }
    assert_error(
        &producer.get("/v1/dead-letters/groups").await,
        403,
        "FORBIDDEN",
        None,
    );
    operator.get("/v1/dead-letters/groups").await.expect(200);
}

/// The handler of [`a_rabbitmq_sources_group_is_archived_redriven_to_the_broker_and_reported`]:
/// while `broken`, every order is refused as one failure (only its number
/// differs); mended, orders marked `still` are refused with another error
/// (a group of their own), the others handled.
#[derive(Clone, Default)]
struct MixedHandler {
    broken: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl MixedHandler {
    async fn start(&self) -> String {
        use axum::http::StatusCode;
        use axum::response::IntoResponse;
        async fn handle(
            axum::extract::State(h): axum::extract::State<MixedHandler>,
            body: axum::body::Bytes,
        ) -> axum::response::Response {
            let order: Value = serde_json::from_slice(&body).unwrap_or_default();
            let n = order["order"].as_u64().unwrap_or_default();
            let refuse = |kind: &str, message: String| {
                let error = json!({"error": {"kind": kind, "message": message}});
                (StatusCode::BAD_REQUEST, axum::Json(error)).into_response()
            };
            if h.broken.load(std::sync::atomic::Ordering::SeqCst) {
                refuse("validation", format!("order {n} has no amount"))
            } else if order["still"] == true {
                refuse("schema", format!("order {n}: field total missing"))
            } else {
                StatusCode::NO_CONTENT.into_response()
            }
        }
        let app = axum::Router::new()
            .route("/orders", axum::routing::post(handle))
            .with_state(self.clone());
        format!("{}/orders", crate::harness::serve_app(app).await)
    }
}

/// Issue 30, part 6, through a RabbitMQ guard source: its dead letters
/// fall into a group that is archived and restored as one; a redrive of
/// the group republishes them to the queue, and its report follows each
/// copy back through the guard: succeeded, or failed again into the group
/// it fell into (still counted so once that group is purged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_sources_group_is_archived_redriven_to_the_broker_and_reported() {
    let test = "a_rabbitmq_sources_group_is_archived_redriven_to_the_broker_and_reported";
    let Some(url) = crate::sources::amqp_url(test) else {
        return;
    };
    let (_conn, ch, queue) = crate::sources::amqp_queue(&url, "groups").await;
    let handler = MixedHandler::default();
    handler
        .broken
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let deliver = handler.start().await;
    let config = crate::sources::orders_from_rabbitmq(&url, &queue, &deliver);
    let server = Server::start(&config).await;
    let api = server.api();
    for (n, still) in [(1, false), (2, false), (3, true), (4, true)] {
        ch.basic_publish(
            "",
            &queue,
            lapin::options::BasicPublishOptions::default(),
            json!({"order": n, "still": still}).to_string().as_bytes(),
            lapin::BasicProperties::default().with_message_id(format!("o-{n}").into()),
        )
        .await
        .expect("publish");
    }
    crate::team_handler::dead_letters(&server, "source=orders", 4).await;

    // One group, of the source.
    let body = groups(&api, "source=orders").await;
    assert_eq!(body["items"].as_array().map(Vec::len), Some(1), "{body}");
    let g = &body["items"][0];
    assert_eq!(
        (g["count"].clone(), g["sources"].clone()),
        (json!(4), json!(["orders"])),
        "{g}"
    );
    assert_eq!(g["fingerprint"], "order <n> has no amount", "{g}");
    let group = g["id"].as_str().expect("an id").to_owned();
    let by_group = json!({"filter": {"group": group}});

    // Archived and restored as one.
    let r = api.post("/v1/dead-letters/archive", &by_group).await;
    assert_eq!(r.expect(200)["archived"], 4);
    assert_eq!(api.dead_letters("source=orders").await.len(), 0);
    assert_eq!(groups(&api, "source=orders").await["items"], json!([]));
    let r = api.post("/v1/dead-letters/restore", &by_group).await;
    assert_eq!(r.expect(200)["restored"], 4);
    assert_eq!(api.dead_letters("source=orders").await.len(), 4);

    // Mended for two of them; the group is redriven to the broker.
    handler
        .broken
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let r = api.post("/v1/dead-letters/redrive", &by_group).await;
    let body = r.expect(200).clone();
    assert_eq!(body["redriven"], 4, "{body}");
    assert!(
        body["items"]
            .as_array()
            .expect("items")
            .iter()
            .all(|i| i["target_queue"] == queue.as_str()),
        "{body}"
    );
    let redrive = body["redrive_id"].as_str().expect("an id").to_owned();
    let path = format!("/v1/redrives/{redrive}");
    let r = api.get(&path).await.expect(200).clone();
    assert_eq!(
        (r["sent"].clone(), r["messages"].clone(), r["jobs"].clone()),
        (json!(4), json!(4), json!(0)),
        "{r}"
    );
    assert_eq!(r["from_groups"], json!([{"group": group, "count": 4}]));

    // Followed through the guard: two succeed, two fail again.
    let seen = std::sync::Mutex::new(Value::Null);
    lazaret_testkit::eventually("the redriven copies are handled", || {
        let (api, path, seen) = (api.clone(), path.clone(), &seen);
        async move {
            let report = api.get(&path).await.expect(200).clone();
            let done = report["running"] == 0;
            *seen.lock().expect("not poisoned") = report;
            done
        }
    })
    .await;
    let report = seen.into_inner().expect("not poisoned");
    assert_eq!(
        (report["succeeded"].clone(), report["failed_again"].clone()),
        (json!(2), json!(2)),
        "{report}"
    );
    let again = api.dead_letters("source=orders").await;
    assert_eq!(again.len(), 2, "{again:#?}");
    let new_group = again[0]["group_id"].as_str().expect("a group").to_owned();
    assert_ne!(new_group, group);
    assert!(
        again.iter().all(|d| d["group_id"] == new_group.as_str()
            && d["source"]["redrive_id"] == redrive.as_str()),
        "{again:#?}"
    );
    assert_eq!(
        report["failed_again_groups"],
        json!([{"group": new_group, "count": 2}]),
        "{report}"
    );

    // Each new dead letter's lineage is the group redrive that sent its
    // message back, from the first group, failed again into this one.
    for d in &again {
        let id = d["id"]
            .as_str()
            .map_or_else(|| d["id"].to_string(), str::to_owned);
        let one = api
            .get(&format!("/v1/dead-letters/{id}"))
            .await
            .expect(200)
            .clone();
        let lineage = one["lineage"].as_array().expect("a lineage").clone();
        assert_eq!(lineage.len(), 1, "{one}");
        assert_eq!(
            (
                lineage[0]["redrive_id"].clone(),
                lineage[0]["from_group"].clone(),
                lineage[0]["payload_edited"].clone(),
                lineage[0]["to"].clone(),
                lineage[0]["outcome"]["group"].clone(),
                lineage[0]["outcome"]["current"].clone(),
            ),
            (
                json!(redrive),
                json!(group),
                json!(false),
                Value::Null,
                json!(new_group),
                json!(true)
            ),
            "{one}"
        );
    }

    // Purged, the new group's dead letters still failed again.
    let r = api
        .post(
            "/v1/dead-letters/purge",
            &json!({"filter": {"group": new_group}, "confirm": true}),
        )
        .await;
    assert_eq!(r.expect(200)["purged"], 2);
    let r = api.get(&path).await.expect(200).clone();
    assert_eq!(
        (
            r["succeeded"].clone(),
            r["failed_again"].clone(),
            r["running"].clone()
        ),
        (json!(2), json!(2), json!(0)),
        "{r}"
    );
}

/// Takes the next message of `queue` (unacknowledged), waiting for one.
async fn amqp_next(ch: &lapin::Channel, queue: &str) -> lapin::message::Delivery {
    let got = std::sync::Mutex::new(None);
    lazaret_testkit::eventually(&format!("a message on {queue}"), || {
        let got = &got;
        async move {
            let taken = ch
                .basic_get(queue, lapin::options::BasicGetOptions { no_ack: false })
                .await
                .expect("basic.get")
                .map(|m| m.delivery);
            let some = taken.is_some();
            if some {
                *got.lock().expect("not poisoned") = taken;
            }
            some
        }
    })
    .await;
    got.into_inner().expect("not poisoned").expect("taken")
}

/// What a watch source's report can and cannot see: lazaret does not
/// handle the messages, so a copy the application handled is never seen
/// to succeed and stays `running`; a copy the application rejects again
/// comes back to the watched dead-letter queue with its redrive id and is
/// `failed_again`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_sources_redrive_report_sees_what_fails_again_and_no_success() {
    use lapin::options::{BasicAckOptions, BasicPublishOptions, BasicRejectOptions};
    use lapin::types::{AMQPValue, FieldTable};

    let test = "a_watch_sources_redrive_report_sees_what_fails_again_and_no_success";
    let Some(url) = crate::sources::amqp_url(test) else {
        return;
    };
    let (_conn, ch, dlq) = crate::sources::amqp_queue(&url, "watch-dlq").await;
    // The application's queue, dead-lettering into the watched one.
    let app = format!("{dlq}-app");
    let mut args = FieldTable::default();
    for (k, v) in [
        ("x-queue-type", "quorum"),
        ("x-dead-letter-exchange", ""),
        ("x-dead-letter-routing-key", dlq.as_str()),
    ] {
        args.insert(k.into(), AMQPValue::LongString(v.into()));
    }
    args.insert("x-expires".into(), AMQPValue::LongInt(15 * 60 * 1000));
    ch.queue_declare(
        &app,
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .expect("declare the application's queue");
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "dlq"
broker = "rabbitmq"
url = "{url}"
queue = "{dlq}"
mode = "watch"
redrive_to = "{app}"
"#
    );
    let server = Server::start(&config).await;
    let api = server.api();
    for n in 1..=2 {
        ch.basic_publish(
            "",
            &app,
            BasicPublishOptions::default(),
            json!({"order": n}).to_string().as_bytes(),
            lapin::BasicProperties::default().with_message_id(format!("o-{n}").into()),
        )
        .await
        .expect("publish");
    }
    // The application rejects both: RabbitMQ dead-letters them.
    for _ in 0..2 {
        let d = amqp_next(&ch, &app).await;
        d.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .expect("basic.reject");
    }
    crate::team_handler::dead_letters(&server, "source=dlq", 2).await;
    let body = groups(&api, "source=dlq").await;
    assert_eq!(body["items"].as_array().map(Vec::len), Some(1), "{body}");
    let group = body["items"][0]["id"].as_str().expect("an id").to_owned();
    assert_eq!(body["items"][0]["sources"], json!(["dlq"]), "{body}");

    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"group": group}}),
        )
        .await;
    let body = r.expect(200).clone();
    assert_eq!(body["redriven"], 2, "{body}");
    let redrive = body["redrive_id"].as_str().expect("an id").to_owned();
    let path = format!("/v1/redrives/{redrive}");

    // The application handles o-1 and rejects o-2 again.
    for _ in 0..2 {
        let d = amqp_next(&ch, &app).await;
        let id = d
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned());
        if id.as_deref() == Some("o-1") {
            d.acker.ack(BasicAckOptions::default()).await.expect("ack");
        } else {
            d.acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .expect("basic.reject");
        }
    }
    let seen = std::sync::Mutex::new(Value::Null);
    lazaret_testkit::eventually("the rejected copy comes back", || {
        let (api, path, seen) = (api.clone(), path.clone(), &seen);
        async move {
            let report = api.get(&path).await.expect(200).clone();
            let done = report["failed_again"] == 1;
            *seen.lock().expect("not poisoned") = report;
            done
        }
    })
    .await;
    let report = seen.into_inner().expect("not poisoned");
    assert_eq!(
        (
            report["messages"].clone(),
            report["succeeded"].clone(),
            report["running"].clone()
        ),
        (json!(2), json!(0), json!(1)),
        "the handled copy is never seen to succeed: {report}"
    );
    assert_eq!(
        report["failed_again_groups"],
        json!([{"group": group, "count": 1}]),
        "{report}"
    );
    let again = api.dead_letters("source=dlq").await;
    assert_eq!(again.len(), 1, "{again:#?}");
    assert_eq!(again[0]["source"]["message_id"], "o-2");
    assert_eq!(again[0]["source"]["redrive_id"], redrive.as_str());
}
