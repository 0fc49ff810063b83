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
