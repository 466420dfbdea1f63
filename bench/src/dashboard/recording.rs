//! A recording of the operator's `/metrics`: each scrape's time and page as served,
//! kept as JSON so that the picture can be drawn again without running the cluster.

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::dashboard::exposition;
use crate::dashboard::promql::store::Store;

#[derive(Serialize, Deserialize)]
pub struct Recording {
    /// How often the operator was scraped, in milliseconds.
    pub scrape_interval_ms: i64,
    pub scrapes: Vec<Scrape>,
}

#[derive(Serialize, Deserialize)]
pub struct Scrape {
    /// When the scrape began, milliseconds since the epoch: the samples' time, as
    /// Prometheus stamps them.
    pub at_ms: i64,
    /// The page, or `None` if the scrape failed.
    pub page: Option<String>,
}

impl Recording {
    /// The samples as Prometheus would have stored them.
    pub fn store(&self) -> Result<Store> {
        let mut store = Store::default();
        for scrape in &self.scrapes {
            let samples = scrape
                .page
                .as_deref()
                .map(exposition::parse)
                .transpose()
                .with_context(|| format!("the scrape at {} ms", scrape.at_ms))?;
            store.append_scrape(scrape.at_ms, samples.as_deref());
        }
        Ok(store)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_vec(self)?).with_context(|| format!("writing {}", path.display()))
    }

    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("{} is not a recording", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dashboard::promql::{self, Value};

    #[test]
    fn a_saved_recording_reads_back_with_its_failed_scrapes() {
        let recording = Recording {
            scrape_interval_ms: 5_000,
            scrapes: vec![
                Scrape {
                    at_ms: 0,
                    page: Some("muster_leader 1\n# EOF\n".into()),
                },
                Scrape {
                    at_ms: 5_000,
                    page: None,
                },
            ],
        };
        let path = std::env::temp_dir().join(format!("muster-recording-{}.json", std::process::id()));
        recording.save(&path).unwrap();
        let loaded = Recording::load(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let store = loaded.store().unwrap();
        let at = |t| match promql::query(&store, "muster_leader", t).unwrap() {
            Value::Vector(v) => v.len(),
            Value::Scalar(_) => unreachable!(),
        };
        assert_eq!(at(0), 1);
        // The failed scrape ends every series.
        assert_eq!(at(5_000), 0);
    }
}
