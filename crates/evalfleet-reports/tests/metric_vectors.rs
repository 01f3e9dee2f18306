//! Our metrics against numbers computed by the reference tools themselves
//! (`tools/metric_vectors.py`): the official SQuAD v1.1 script for exact
//! match and F1, jiwer for WER and CER, HumanEval's estimator for pass@k.

use evalfleet_eval::{Metric, text};
use evalfleet_reports::stats::pass_at_k;
use serde_json::{Map, Value, json};

fn vectors() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/metric_vectors.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn metric(name: &str, params: Value) -> Metric {
    Metric::build(name, params.as_object().unwrap_or(&Map::new()), None).unwrap()
}

#[test]
fn squad_exact_match_and_f1_agree_with_the_official_script() {
    let v = vectors();
    let cases = v["squad"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let em = metric("exact_match", json!({"normalize": "squad"}));
    let f1 = metric("f1", json!({}));
    for case in cases {
        let prediction = &case["prediction"];
        let references: Vec<Value> = case["references"].as_array().unwrap().clone();
        let got_em = em.score(prediction, &references)["value"].as_f64().unwrap();
        let got_f1 = f1.score(prediction, &references)["value"].as_f64().unwrap();
        let want_em = case["exact_match"].as_f64().unwrap();
        let want_f1 = case["f1"].as_f64().unwrap();
        assert!(close(got_em, want_em), "EM of {case}: got {got_em}");
        assert!(close(got_f1, want_f1), "F1 of {case}: got {got_f1}");
    }
}

#[test]
fn wer_and_cer_agree_with_jiwer() {
    let v = vectors();
    let wer = metric("wer", json!({}));
    let cer = metric("cer", json!({}));
    let (mut word_edits, mut words, mut char_edits, mut chars) = (0, 0, 0, 0);
    for case in v["jiwer"]["cases"].as_array().unwrap() {
        let reference = case["reference"].clone();
        let hypothesis = &case["hypothesis"];
        let w = wer.score(hypothesis, std::slice::from_ref(&reference));
        let c = cer.score(hypothesis, std::slice::from_ref(&reference));
        assert!(
            close(w["value"].as_f64().unwrap(), case["wer"].as_f64().unwrap()),
            "WER of {case}: got {w}"
        );
        assert!(
            close(c["value"].as_f64().unwrap(), case["cer"].as_f64().unwrap()),
            "CER of {case}: got {c}"
        );
        word_edits += w["edits"].as_u64().unwrap();
        words += w["length"].as_u64().unwrap();
        char_edits += c["edits"].as_u64().unwrap();
        chars += c["length"].as_u64().unwrap();
    }
    // jiwer's corpus figures pool edits over all references, as our
    // aggregates' `pooled` does.
    assert!(close(
        word_edits as f64 / words as f64,
        v["jiwer"]["corpus_wer"].as_f64().unwrap()
    ));
    assert!(close(
        char_edits as f64 / chars as f64,
        v["jiwer"]["corpus_cer"].as_f64().unwrap()
    ));
}

#[test]
fn pass_at_k_agrees_with_the_humaneval_estimator() {
    let v = vectors();
    for case in v["pass_at_k"].as_array().unwrap() {
        let (n, c, k) = (
            case["n"].as_u64().unwrap(),
            case["c"].as_u64().unwrap(),
            case["k"].as_u64().unwrap(),
        );
        let got = pass_at_k(n, c, k);
        assert!(
            close(got, case["pass_at_k"].as_f64().unwrap()),
            "pass@{k} of n={n}, c={c}: got {got}"
        );
    }
}

#[test]
fn squad_normaliser_is_the_one_the_vectors_exercise() {
    // The vectors include punctuation inside words, repeated articles and
    // accents; the normaliser keeps non-ASCII letters.
    assert_eq!(
        text::squad_normalize("Théâtre de l'Odéon"),
        "théâtre de lodéon"
    );
}
