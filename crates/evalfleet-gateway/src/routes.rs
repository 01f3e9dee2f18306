//! Which endpoints answer which model names (`task.models`).

use std::sync::Arc;

use evalfleet_fleet::Endpoint;

/// Which endpoints answer which model names.
pub(crate) struct Routes {
    /// `task.models`: a name, and the endpoints (indexes) it maps to.
    pub(crate) aliases: Vec<(String, Vec<usize>)>,
    /// Any other name (`*`, or the endpoints that answer items when
    /// `task.models` is empty).
    default: Option<Vec<usize>>,
}

impl Routes {
    pub(crate) fn new(
        endpoints: &[Arc<Endpoint>],
        models: &[(String, String)],
    ) -> Result<Self, String> {
        let items: Vec<usize> = (0..endpoints.len())
            .filter(|i| endpoints[*i].config.takes_items())
            .collect();
        let mut aliases = Vec::new();
        let mut default = None;
        for (name, to) in models {
            let targets: Vec<usize> = (0..endpoints.len())
                .filter(|i| endpoints[*i].name == *to || endpoints[*i].model == *to)
                .collect();
            if targets.is_empty() {
                return Err(format!(
                    "task.models.{name}: no endpoint is named '{to}' or serves a model of that name"
                ));
            }
            if name == "*" {
                default = Some(targets);
            } else {
                aliases.push((name.clone(), targets));
            }
        }
        if models.is_empty() && !items.is_empty() {
            default = Some(items);
        }
        Ok(Self { aliases, default })
    }

    /// The endpoints for the model `name`.
    pub(crate) fn resolve(&self, name: &str, endpoints: &[Arc<Endpoint>]) -> Option<Vec<usize>> {
        if let Some((_, targets)) = self.aliases.iter().find(|(n, _)| n == name) {
            return Some(targets.clone());
        }
        // A judge's endpoint is reached only where task.models names it.
        let named: Vec<usize> = (0..endpoints.len())
            .filter(|i| endpoints[*i].config.takes_items())
            .filter(|i| endpoints[*i].model == name || endpoints[*i].name == name)
            .collect();
        if !named.is_empty() {
            return Some(named);
        }
        self.default.clone()
    }
}
