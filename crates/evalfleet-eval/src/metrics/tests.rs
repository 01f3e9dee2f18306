use super::*;

fn metric(name: &str, params: Value) -> Metric {
    Metric::build(name, params.as_object().unwrap(), None).unwrap()
}

fn value(score: &Value) -> f64 {
    score["value"].as_f64().unwrap()
}

#[test]
fn unknown_names_versions_and_parameters_are_refused() {
    let none = Map::new();
    let far = Metric::build("bleu", &none, None).unwrap_err();
    assert!(
        far.starts_with("unknown metric 'bleu' (known: ") && far.contains("exact_match"),
        "{far}"
    );
    assert_eq!(
        Metric::build("exact_mach", &none, None).unwrap_err(),
        "unknown metric 'exact_mach' (did you mean 'exact_match'?)"
    );
    assert!(
        Metric::build("exact_match@2", &none, None)
            .unwrap_err()
            .contains("no version 2")
    );
    let params = json!({"colour": 1});
    let err = Metric::build("f1", params.as_object().unwrap(), None).unwrap_err();
    assert_eq!(err, "f1 takes no parameters, got 'colour'");
    assert_eq!(
        Metric::build("exact_match@1", &none, None).unwrap().key,
        "exact_match@1"
    );
}

fn backend() -> BackendSpec {
    BackendSpec {
        name: "evalscope".to_owned(),
        version: 2,
        command: vec!["python3".to_owned(), "score.py".to_owned()],
        setup: None,
        timeout: std::time::Duration::from_secs(1),
        setup_timeout: std::time::Duration::from_secs(1),
        queue: 1,
        metrics: vec![super::super::backend::BackendMetric {
            name: "cer".to_owned(),
            higher_is_better: false,
            summary: String::new(),
        }],
        dir: std::path::PathBuf::new(),
    }
}

#[test]
fn native_names_keep_their_stored_keys_and_backend_names_have_three_parts() {
    let none = Map::new();
    let backends = [backend()];
    let key = |name: &str| {
        Metric::build_with(name, &none, None, &backends)
            .map(|m| (m.key.clone(), m.backend().to_owned()))
    };
    // Every spelling of the built-in anls is stored as runs always had it.
    for name in ["anls", "anls@1", "anls@native", "anls@native@1"] {
        assert_eq!(
            key(name),
            Ok(("anls@1".to_owned(), "native".to_owned())),
            "{name}"
        );
    }
    for name in ["cer@evalscope", "cer@evalscope@2"] {
        assert_eq!(
            key(name),
            Ok(("cer@evalscope@2".to_owned(), "evalscope".to_owned())),
            "{name}"
        );
    }
    let m = Metric::build_with("cer@evalscope", &none, None, &backends).unwrap();
    assert!(!m.higher_is_better && !m.scored_here() && !m.needs_reference());
    assert!(key("cer@evalscope@1").unwrap_err().contains("version 2"));
    assert!(
        key("anls@evalscope")
            .unwrap_err()
            .contains("gives no metric 'anls'")
    );
    assert!(
        key("anls@other")
            .unwrap_err()
            .contains("unknown metric backend 'other'")
    );
    assert!(key("anls@native@2").unwrap_err().contains("no version 2"));
    assert!(key("anls@a@1@2").is_err());
    // Parameters of a backend's metric are its program's business.
    let params = json!({"anything": [1, 2]});
    let m = Metric::build_with(
        "cer@evalscope",
        params.as_object().unwrap(),
        None,
        &backends,
    );
    assert!(m.is_ok());
}

#[test]
fn the_listing_has_every_built_in_metric_then_the_backends() {
    let listed = listing(&[backend()]);
    assert_eq!(listed.len(), REGISTRY.len() + 1);
    let last = listed.last().unwrap();
    assert_eq!(
        (
            last.key.as_str(),
            last.backend.as_str(),
            last.params.is_none()
        ),
        ("cer@evalscope@2", "evalscope", true)
    );
    assert!(
        listed
            .iter()
            .any(|l| l.key == "anls@1" && l.backend == "native")
    );
}

#[test]
fn numeric_match_ignores_separators_and_units() {
    let m = metric("numeric_match", json!({}));
    assert_eq!(value(&m.score(&json!("1,234"), &[json!("1234")])), 1.0);
    assert_eq!(value(&m.score(&json!("$18 dollars"), &[json!("18")])), 1.0);
    assert_eq!(value(&m.score(&json!("17"), &[json!("18")])), 0.0);
    let loose = metric("numeric_match", json!({"relative_tolerance": 0.01}));
    assert_eq!(value(&loose.score(&json!("100.5"), &[json!("100")])), 1.0);
}

#[test]
fn anls_at_the_threshold_scores_zero() {
    let m = metric("anls", json!({}));
    // "ab" vs "cd": distance 1.0; "abcd" vs "abxy": exactly 0.5.
    assert_eq!(value(&m.score(&json!("abxy"), &[json!("abcd")])), 0.0);
    let s = value(&m.score(&json!("abcx"), &[json!("abcd")]));
    assert!((s - 0.75).abs() < 1e-12);
    // Case and surrounding or repeated whitespace do not count.
    assert_eq!(
        value(&m.score(
            &json!("  Hello   World"),
            &[json!("x"), json!("hello world")]
        )),
        1.0
    );
}

#[test]
fn json_fields_count_nested_paths() {
    let m = metric("json_field_match", json!({}));
    let want =
        json!({"name": "Ann", "address": {"city": "Oslo", "zip": "0150"}, "tags": ["a", "b"]});
    let got = json!({"name": "Ann", "address": {"city": "Bergen", "zip": "0150"}, "tags": ["a"], "extra": 1});
    let s = m.score(&got, &[want]);
    // Right: name, address.zip, tags[0]; wrong: city; missing: tags[1].
    assert!((value(&s) - 3.0 / 5.0).abs() < 1e-12);
    assert_eq!(
        (s["tp"].as_u64(), s["fp"].as_u64(), s["fn"].as_u64()),
        (Some(3), Some(2), Some(2))
    );
}

#[test]
fn choices_match_letters_or_indices() {
    let m = metric("choice_accuracy", json!({}));
    assert_eq!(value(&m.score(&json!("C"), &[json!("C")])), 1.0);
    assert_eq!(value(&m.score(&json!("C"), &[json!(2)])), 1.0);
    assert_eq!(value(&m.score(&json!("B"), &[json!("(C)")])), 0.0);
}

#[test]
fn judge_replies_become_scaled_scores() {
    let m = metric(
        "llm_judge",
        json!({"endpoint": "j", "rubric": "Rate {{ answer }}", "scale": [1, 5]}),
    );
    assert_eq!(m.llm_judge_score("Fine work.\nScore: 4")["value"], 0.75);
    assert_eq!(m.llm_judge_score("score = **5**")["value"], 1.0);
    assert!(
        m.llm_judge_score("I like it")["error"]
            .as_str()
            .unwrap()
            .contains("no score")
    );
    assert!(
        Metric::build(
            "llm_judge",
            json!({"rubric": "x"}).as_object().unwrap(),
            None
        )
        .unwrap_err()
        .contains("needs endpoint")
    );
}

#[test]
fn classification_folds_unknown_labels() {
    let m = metric("classification", json!({"labels": ["pos", "neg"]}));
    let s = m.score(&json!("Neutral"), &[json!("neg")]);
    assert_eq!(s["predicted"], "(other)");
    assert_eq!(value(&m.score(&json!(" POS "), &[json!("pos")])), 1.0);
}
