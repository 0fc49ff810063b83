//! `[[tokens]]`.

use super::*;

#[test]
fn a_bad_role_is_refused() {
    let e = assert_refused(
        "[[tokens]]\nname = \"a\"\nrole = \"root\"\ntoken = \"s\"\n",
        "tokens[0].role",
        3,
        "unknown role `root`",
    );
    assert!(
        e.to_string().contains("producer, worker, operator, admin"),
        "{e}"
    );
    assert_eq!("admin".parse::<Role>(), Ok(Role::Admin));
    for r in Role::ALL {
        assert_eq!(r.as_str().parse::<Role>(), Ok(r));
    }
}

#[test]
fn a_token_needs_exactly_one_secret() {
    assert_refused(
        "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken = \"s\"\ntoken_sha256 = \"00\"\n",
        "tokens[0].token_sha256",
        5,
        "not both",
    );
    let e = parse("[[tokens]]\nname = \"a\"\nrole = \"admin\"\n").unwrap_err();
    assert_eq!(e.key(), Some("tokens[0]"), "{e}");
    assert!(e.to_string().contains("token_sha256 = "), "{e}");
    assert_refused(
        "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken_sha256 = \"abc\"\n",
        "tokens[0].token_sha256",
        4,
        "64 hex digits",
    );
    let upper = hex::encode_upper(token_sha256("s"));
    let cfg = parse(&format!(
        "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken_sha256 = \"{upper}\"\n"
    ))
    .unwrap();
    assert_eq!(cfg.tokens[0].sha256, token_sha256("s"));
}

#[test]
fn two_tokens_may_share_neither_name_nor_secret() {
    let e = assert_refused(
        "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken = \"s1\"\n\
         [[tokens]]\nname = \"a\"\nrole = \"worker\"\ntoken = \"s2\"\n",
        "tokens[1].name",
        6,
        "already used by tokens[0] (line 2)",
    );
    assert!(!e.to_string().contains("s1"), "{e}");
    let hash = hex::encode(token_sha256("s1"));
    let e = assert_refused(
        &format!(
            "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken = \"s1\"\n\
             [[tokens]]\nname = \"b\"\nrole = \"worker\"\ntoken_sha256 = \"{hash}\"\n"
        ),
        "tokens[1].token_sha256",
        8,
        "secret of token `a`",
    );
    assert!(!e.to_string().contains("s1"), "{e}");
}
