//! Bringing up a run's endpoints: `mock` endpoints are started inside this
//! process on a free port; `external` ones are used where they are.

use std::sync::Arc;

use anyhow::Context;
use evalfleet_core::client::ChatClient;
use evalfleet_core::config::{Config, EndpointConfig, EndpointKind};
use evalfleet_core::fleet::Endpoint;
use evalfleet_mock::MockServer;

/// The endpoints of a session, and the mock servers it runs.
pub struct Fleet {
    pub endpoints: Vec<Arc<Endpoint>>,
    mocks: Vec<MockServer>,
}

/// Where an endpoint is reached, starting its mock when it is one.
pub async fn base_url(
    endpoint: &EndpointConfig,
    mocks: &mut Vec<MockServer>,
) -> anyhow::Result<String> {
    Ok(match &endpoint.kind {
        EndpointKind::Mock(settings) => {
            let server = MockServer::start_local((**settings).clone())
                .await
                .with_context(|| {
                    format!("cannot start the mock for endpoint '{}'", endpoint.name)
                })?;
            let url = server.base_url();
            mocks.push(server);
            url
        }
        EndpointKind::External { base_url } => base_url.clone(),
    })
}

impl Fleet {
    pub async fn start(config: &Config) -> anyhow::Result<Self> {
        let mut mocks = Vec::new();
        let mut endpoints = Vec::with_capacity(config.endpoints.len());
        for endpoint in &config.endpoints {
            let url = base_url(endpoint, &mut mocks).await?;
            let client = ChatClient::new(endpoint, &url, &config.task.params, config.task.stream)
                .map_err(|err| anyhow::anyhow!("endpoint '{}': {err}", endpoint.name))?;
            endpoints.push(Arc::new(Endpoint::new(
                endpoint,
                client,
                config.timeouts.attempt,
            )));
        }
        Ok(Self { endpoints, mocks })
    }

    /// The endpoints' concurrency limits, in order.
    pub fn limits(&self) -> Vec<usize> {
        self.endpoints.iter().map(|e| e.limit.current()).collect()
    }

    /// Stops the mocks this process started.
    pub async fn stop(self) {
        for mock in self.mocks {
            if let Err(err) = mock.shutdown().await {
                tracing::warn!("A mock endpoint did not stop cleanly: {err}.");
            }
        }
    }
}
