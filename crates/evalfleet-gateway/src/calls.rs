//! An agent's call: checked against its attempt's budget, answered from
//! the cache when it may be, else routed to an endpoint of its model with
//! a free slot and made on the fleet's one call path, going to another
//! endpoint when it fails before its first byte; and its record.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use evalfleet_types::{AgentCall, ErrorClass, Failover, Telemetry, now_ms};
use serde_json::{Map, Value};
use tokio::sync::oneshot;
use tokio::time::Instant;

use evalfleet_fleet::call::{self, Call, Exchange};
use evalfleet_fleet::client::{Api, Head};
use evalfleet_fleet::{Endpoint, Permit};

use super::cache::{from_cache, message_of, to_cache};
use super::error::{GatewayError, failure_answer};
use super::grant::{Flight, Grant};
use super::{Answer, Asked, Gateway};

impl Gateway {
    /// Makes the call `asked` for the attempt of `grant`.
    pub async fn call(self: &Arc<Self>, grant: Arc<Grant>, asked: Asked) -> Answer {
        // Counted under way before the attempt can be seen closed: a close
        // then waits for this call's record.
        let flight = Flight::enter(&grant);
        if grant.closed.load(Ordering::Acquire) {
            return Answer::Error(GatewayError::unauthorized(
                "the token's attempt has ended: it is no longer valid.",
            ));
        }
        let index = grant.next_index.fetch_add(1, Ordering::AcqRel) + 1;
        let mut record = AgentCall {
            seq: grant.seq,
            attempt: grant.attempt,
            index,
            call_id: format!("{}.{}.{}", grant.seq, grant.attempt, index),
            api: asked.api.name().to_owned(),
            sent_at_ms: now_ms(),
            request: evalfleet_fleet::client::cut_body(&String::from_utf8_lossy(&asked.body)),
            request_cut: asked.body.len() > evalfleet_types::BODY_KEPT,
            ..AgentCall::default()
        };
        if let Some(refused) = grant
            .too_large(asked.body.len())
            .or_else(|| grant.over_budget(index))
        {
            return self.refuse(&grant, record, refused);
        }
        let body = match serde_json::from_slice::<Value>(&asked.body) {
            Ok(Value::Object(body)) => body,
            Ok(_) => {
                return self.refuse(
                    &grant,
                    record,
                    GatewayError::bad_request("the request body must be a JSON object."),
                );
            }
            Err(err) => {
                return self.refuse(
                    &grant,
                    record,
                    GatewayError::bad_request(format!("the request body is not JSON: {err}.")),
                );
            }
        };
        record.tags = tags(&body, asked.traceparent.as_deref());
        let Some(asked_model) = body.get("model").and_then(Value::as_str).map(str::to_owned) else {
            return self.refuse(
                &grant,
                record,
                GatewayError::bad_request("the request names no model."),
            );
        };
        record.asked_model = asked_model.clone();
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        record.stream = stream;
        if stream && asked.api == Api::Embeddings {
            return self.refuse(
                &grant,
                record,
                GatewayError::bad_request("embeddings are not streamed."),
            );
        }
        let Some(candidates) = self.routes.resolve(&asked_model, &self.endpoints) else {
            let error = GatewayError::new(
                404,
                "invalid_request_error",
                "model_not_found",
                format!("The model '{asked_model}' is not served by this run (task.models names the models an agent may ask for)."),
            )
            .final_();
            return self.refuse(&grant, record, error);
        };
        let cache_key = self.cache_key(asked.api, grant.sample, index, &candidates, &body);
        // A retry reads nothing from the cache: the answers that made the
        // attempt before it fail would make it fail again.
        let reads = grant.attempt == 1;
        if let (Some(key), Some(get), true) = (
            &cache_key,
            self.cache.get().and_then(|c| c.get.clone()),
            reads,
        ) && let Some(hit) = get(key.clone()).await
            && let Some(answer) = from_cache(&hit, stream)
        {
            record.cached = true;
            record.http_status = 200;
            record.telemetry = Telemetry {
                endpoint: hit.endpoint.clone(),
                model: hit.model.clone(),
                prompt_tokens: hit.prompt_tokens,
                completion_tokens: hit.completion_tokens,
                finish_reason: hit.finish_reason.clone(),
                ..Telemetry::default()
            };
            record.response = message_of(&hit.content);
            grant.ended(record);
            return answer;
        }
        let max_tokens = body
            .get("max_completion_tokens")
            .or_else(|| body.get("max_tokens"))
            .or_else(|| body.get("max_output_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(256);
        let cost = asked.body.len() as u64 / 4 + max_tokens;
        let mut left: Vec<Arc<Endpoint>> = candidates
            .iter()
            .map(|i| self.endpoints[*i].clone())
            .collect();
        let mut last: Option<(Exchange, Arc<Endpoint>, Head)> = None;
        while !left.is_empty() {
            let home = grant.home.lock().ok().and_then(|home| home.clone());
            let Some((endpoint, permit, client)) = self.admit_any(&left, home.as_deref()).await
            else {
                break;
            };
            left.retain(|e| !Arc::ptr_eq(e, &endpoint));
            if !call::pace(&endpoint, cost, &self.stop).await {
                break;
            }
            let sent = rewrite(&body, &endpoint.model, asked.api, stream);
            let (head_tx, head_rx) = oneshot::channel();
            let (done_tx, done_rx) = oneshot::channel();
            let fleet = self.fleet.clone();
            let api = asked.api;
            let for_call = endpoint.clone();
            let grant_for = grant.clone();
            let mut partial = record.clone();
            let put = cache_key
                .clone()
                .zip(self.cache.get().and_then(|c| c.put.clone()));
            let flight_for = flight.clone();
            let abandon = grant.abandon.clone();
            self.tracker.spawn(async move {
                let _flight = flight_for;
                let mut kept = None;
                let delivered = std::sync::atomic::AtomicBool::new(false);
                let timeout = for_call.timeout;
                let exchange = call::send_with(
                    Call {
                        endpoint: for_call.clone(),
                        client: client.clone(),
                        permit,
                        cost,
                    },
                    async {
                        let forwarded =
                            client.forward(api, sent, stream, head_tx, &delivered).await;
                        kept = forwarded.response;
                        forwarded.outcome
                    },
                    timeout,
                    &abandon,
                    &fleet,
                )
                .await;
                if delivered.load(Ordering::Acquire) {
                    // The agent has (or is reading) this answer: it is the
                    // call's record.
                    partial.response = kept;
                    fill(&mut partial, &exchange, &for_call);
                    if let (Some((key, put)), Exchange::Done { result: Ok(_), .. }) =
                        (put, &exchange)
                        && let Some(entry) = to_cache(key, api, &partial)
                    {
                        put(entry);
                    }
                    grant_for.ended(partial);
                } else if let Err((exchange, kept)) = done_tx.send((exchange, kept)) {
                    // Nobody waits for it (the agent went away): recorded
                    // as it ended.
                    partial.response = kept;
                    fill(&mut partial, &exchange, &for_call);
                    grant_for.ended(partial);
                }
            });
            // No head: the call ended before its first byte without a word
            // (its time ran out, its endpoint was taken out of service, the
            // attempt ended): a failure like any other before the first byte.
            let head = head_rx.await.unwrap_or(Head::Failed {
                status: None,
                content_type: None,
                body: Bytes::new(),
            });
            match head {
                Head::Failed {
                    status,
                    content_type,
                    body: error_body,
                } => {
                    let (exchange, kept) = match done_rx.await {
                        Ok(done) => done,
                        Err(_) => break,
                    };
                    let failed = Head::Failed {
                        status,
                        content_type,
                        body: error_body,
                    };
                    // An endpoint's own refusal of evalfleet (its key, a
                    // model or API it lacks) is its fault, not the agent's.
                    let again = match status {
                        None => true,
                        Some(status) => {
                            matches!(status, 401 | 403 | 404 | 408 | 429) || status >= 500
                        }
                    };
                    if again && !left.is_empty() {
                        tracing::debug!(
                            "Gateway call {} failed on {} before its first byte; trying another endpoint.",
                            record.call_id,
                            endpoint.name
                        );
                        // Kept with the call: the endpoint's failure is
                        // its own, whoever answered the agent in the end.
                        record
                            .failovers
                            .push(failover(&record, &exchange, &endpoint));
                        last = Some((exchange, endpoint, failed));
                        continue;
                    }
                    record.response = kept;
                    fill(&mut record, &exchange, &endpoint);
                    let answer = failure_answer(&exchange, failed);
                    grant.ended(record);
                    return answer;
                }
                head => return Answer::Head(head),
            }
        }
        if let Some((exchange, endpoint, failed)) = last {
            // The last try failed too: it is the call's own outcome, not a
            // failover.
            record.failovers.pop();
            fill(&mut record, &exchange, &endpoint);
            let answer = failure_answer(&exchange, failed);
            grant.ended(record);
            return answer;
        }
        let mut error = GatewayError::new(
            503,
            "server_error",
            "no_endpoint",
            format!(
                "No endpoint for model '{asked_model}' took the call within {}.",
                humantime::format_duration(self.wait)
            ),
        );
        error.retry_after = Some(1);
        self.refuse(&grant, record, error)
    }

    /// Records a call refused before any endpoint was asked, and answers it.
    fn refuse(&self, grant: &Grant, mut record: AgentCall, error: GatewayError) -> Answer {
        record.http_status = error.status;
        record.error = Some(error.message.clone());
        record.error_class = Some(if error.status == 429 || error.status == 503 {
            ErrorClass::BackPressure
        } else {
            ErrorClass::Fatal
        });
        grant.ended(record);
        Answer::Error(error)
    }

    /// Waits until one of `endpoints` takes calls and has a free slot; the
    /// first to have one takes the call.
    async fn admit_any(
        &self,
        endpoints: &[Arc<Endpoint>],
        home: Option<&str>,
    ) -> Option<(
        Arc<Endpoint>,
        Permit,
        Arc<evalfleet_fleet::client::ChatClient>,
    )> {
        let deadline = Instant::now() + self.wait;
        loop {
            // The item's home first, while it takes calls and has room;
            // then the least loaded (in flight for its limit; ties drawn at
            // random): the first of them with a free slot takes the call.
            let mut ordered: Vec<(f64, u64, &Arc<Endpoint>)> = endpoints
                .iter()
                .map(|e| {
                    let (in_flight, limit) = (e.limit.in_flight(), e.limit.current().max(1));
                    let load =
                        if home == Some(e.name.as_str()) && in_flight < limit && e.accepting() {
                            -1.0
                        } else {
                            in_flight as f64 / limit as f64
                        };
                    (load, fastrand::u64(..), e)
                })
                .collect();
            ordered.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let waits: Vec<_> = ordered
                .into_iter()
                .map(|(_, _, endpoint)| {
                    let stop = self.stop.clone();
                    Box::pin(async move {
                        let permit = call::admit(endpoint, &stop).await?;
                        Some((endpoint.clone(), permit))
                    })
                })
                .collect();
            let first =
                tokio::time::timeout_at(deadline, futures_util::future::select_all(waits)).await;
            let (endpoint, permit) = match first {
                Ok((Some(admitted), _, _)) => admitted,
                Ok((None, _, _)) | Err(_) => return None,
            };
            match endpoint.client() {
                Some(client) => return Some((endpoint, permit, client)),
                // Not started yet (or restarting): another turn.
                None => {
                    drop(permit);
                    if tokio::time::timeout_at(
                        deadline,
                        tokio::time::sleep(Duration::from_millis(50)),
                    )
                    .await
                    .is_err()
                    {
                        return None;
                    }
                }
            }
        }
    }
}

/// The body sent to an endpoint: the agent's, with the endpoint's model,
/// and a stream's usage asked for.
fn rewrite(body: &Map<String, Value>, model: &str, api: Api, stream: bool) -> Bytes {
    let mut body = body.clone();
    body.insert("model".to_owned(), Value::String(model.to_owned()));
    if stream && matches!(api, Api::ChatCompletions | Api::Completions) {
        let options = body
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(options) = options {
            options.insert("include_usage".to_owned(), Value::Bool(true));
        } else {
            *options = serde_json::json!({"include_usage": true});
        }
    }
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// The tags a request carries: `traceparent`, `user`, `metadata`.
fn tags(body: &Map<String, Value>, traceparent: Option<&str>) -> Option<String> {
    let mut tags = Map::new();
    if let Some(trace) = traceparent {
        tags.insert(
            "traceparent".to_owned(),
            Value::String(trace.chars().take(256).collect()),
        );
    }
    for key in ["user", "metadata"] {
        if let Some(value) = body.get(key).filter(|v| !v.is_null()) {
            tags.insert(key.to_owned(), value.clone());
        }
    }
    (!tags.is_empty()).then(|| evalfleet_fleet::client::cut_body(&Value::Object(tags).to_string()))
}

/// Fills `record` with what `exchange` on `endpoint` came to.
/// What a try of `record`'s call that failed on `endpoint` before its
/// first byte came to, as [`fill`] would record it.
fn failover(record: &AgentCall, exchange: &Exchange, endpoint: &Endpoint) -> Failover {
    let mut tried = AgentCall {
        seq: record.seq,
        attempt: record.attempt,
        ..AgentCall::default()
    };
    fill(&mut tried, exchange, endpoint);
    Failover {
        endpoint: tried.telemetry.endpoint,
        latency_ms: tried.telemetry.latency_ms,
        http_status: Some(tried.http_status).filter(|s| *s != 0),
        error_class: tried.error_class,
        error: tried.error,
    }
}

fn fill(record: &mut AgentCall, exchange: &Exchange, endpoint: &Endpoint) {
    record.telemetry = Telemetry {
        endpoint: endpoint.name.clone(),
        model: endpoint.model.clone(),
        ..Telemetry::default()
    };
    match exchange {
        // What the store keeps of any call (an attempt's record), with the
        // status the agent got.
        Exchange::Done { .. } => {
            if let Some(attempt) = exchange.record(endpoint, record.seq, record.attempt, 0) {
                record.sent_at_ms = attempt.sent_at_ms;
                record.telemetry = attempt.telemetry;
                record.http_status = attempt.http_status.unwrap_or(502);
                record.error_class = attempt.error_class;
                record.error = attempt.error;
            }
        }
        Exchange::Moved { .. } => {
            record.http_status = 503;
            record.error_class = Some(ErrorClass::BackPressure);
            record.error = Some(format!(
                "{} stopped taking calls during the call",
                endpoint.name
            ));
        }
        Exchange::Cancelled { why, .. } => {
            record.http_status = 499;
            record.error = Some(format!("cancelled: {why}"));
        }
        Exchange::Abandoned => {
            record.http_status = 499;
            record.error = Some("abandoned: the run stopped".to_owned());
        }
    }
}
