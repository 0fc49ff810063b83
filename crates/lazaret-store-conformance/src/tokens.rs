//! Tokens: API-created tokens are kept (hash only), listed, refused when a
//! name or secret is taken, revoked, audited in the same call, and survive a
//! restart; and the name of the token that enqueued a job is kept with it.

use lazaret_store::{ApiToken, AuditEntry, NewJob, Store, TokenError};

use crate::Backend;

use super::{at, enqueue_one, job_view, new_job, sha256_hex};

/// A token named `name` with role `role`, created by `root` at `at(ms)`.
fn token(name: &str, role: &str, ms: i64) -> ApiToken {
    ApiToken {
        name: name.into(),
        role: role.into(),
        token_sha256: sha256_hex(format!("secret-of-{name}").as_bytes()),
        created_at: at(ms),
        created_by: "root".into(),
    }
}

fn entry(action: &str, name: &str, ms: i64) -> AuditEntry {
    AuditEntry {
        at: at(ms),
        actor: "root".into(),
        action: action.into(),
        request: serde_json::json!({ "name": name }),
        count: 1,
    }
}

async fn create<S: Store>(s: &S, t: &ApiToken, ms: i64) -> Result<(), TokenError> {
    s.create_token(t.clone(), entry("token_create", &t.name, ms))
        .await
        .expect("create_token")
}

pub async fn created_tokens_are_listed_oldest_first_and_survive_a_restart<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    assert!(s.tokens().await.unwrap().is_empty(), "a new store has none");
    let ci = token("ci-producer", "producer", 20);
    let night = token("night-worker", "worker", 10);
    create(&s, &ci, 20).await.unwrap();
    create(&s, &night, 10).await.unwrap();
    let listed = s.tokens().await.unwrap();
    assert_eq!(listed, vec![night.clone(), ci.clone()]);

    s.close().await.unwrap();
    drop(s);
    let s = b.open(&place).await;
    assert_eq!(
        s.tokens().await.unwrap(),
        vec![night, ci],
        "tokens survive a restart, hash, role and creator included"
    );
}

pub async fn a_taken_name_or_secret_is_refused_and_changes_nothing<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let first = token("ci", "producer", 1);
    create(&s, &first, 1).await.unwrap();

    let same_name = ApiToken {
        role: "admin".into(),
        token_sha256: sha256_hex(b"another secret"),
        ..token("ci", "admin", 2)
    };
    assert_eq!(create(&s, &same_name, 2).await, Err(TokenError::NameTaken));
    let same_secret = ApiToken {
        token_sha256: first.token_sha256.clone(),
        ..token("other", "worker", 3)
    };
    assert_eq!(
        create(&s, &same_secret, 3).await,
        Err(TokenError::SecretTaken)
    );

    assert_eq!(
        s.tokens().await.unwrap(),
        vec![first],
        "the first one stays"
    );
    let audit = s.audit_log(10).await.unwrap();
    assert_eq!(
        audit,
        vec![entry("token_create", "ci", 1)],
        "a refused create writes no audit entry"
    );
}

pub async fn revoke_deletes_the_token_and_audits_it<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let keep = token("keep", "operator", 1);
    let gone = token("gone", "producer", 2);
    create(&s, &keep, 1).await.unwrap();
    create(&s, &gone, 2).await.unwrap();

    assert!(
        s.revoke_token("gone".into(), entry("token_revoke", "gone", 3))
            .await
            .unwrap()
    );
    assert_eq!(s.tokens().await.unwrap(), vec![keep.clone()]);
    // Unknown (or already revoked): false, and nothing audited.
    assert!(
        !s.revoke_token("gone".into(), entry("token_revoke", "gone", 4))
            .await
            .unwrap()
    );
    assert!(
        !s.revoke_token("nobody".into(), entry("token_revoke", "nobody", 5))
            .await
            .unwrap()
    );
    let audit = s.audit_log(10).await.unwrap();
    assert_eq!(
        audit,
        vec![
            entry("token_revoke", "gone", 3),
            entry("token_create", "gone", 2),
            entry("token_create", "keep", 1),
        ]
    );

    // A revoked name and its secret may be used again.
    create(&s, &gone, 6).await.unwrap();
    assert_eq!(s.tokens().await.unwrap(), vec![keep, gone]);
}

pub async fn the_enqueuing_tokens_name_is_kept_with_the_job<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let mine = enqueue_one(
        &s,
        NewJob {
            enqueued_by: Some("shop-frontend".into()),
            ..new_job("report", "acme", "default")
        },
    )
    .await;
    let anonymous = enqueue_one(&s, new_job("report", "acme", "default")).await;
    assert_eq!(
        job_view(&s, mine).await.enqueued_by.as_deref(),
        Some("shop-frontend")
    );
    assert_eq!(job_view(&s, anonymous).await.enqueued_by, None);
}
