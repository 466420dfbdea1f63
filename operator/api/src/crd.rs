//! The CustomResourceDefinitions muster serves, and their YAML rendering.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};
use kube::CustomResourceExt;

use crate::v1alpha1::Workload;

/// Failure to render the CRDs.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    /// The CRD could not be serialised to YAML.
    #[error("cannot render CRD {name} as YAML: {source}")]
    Yaml {
        /// CRD name.
        name: String,
        /// Underlying serialiser error.
        #[source]
        source: serde_saphyr::ser::Error,
    },
}

/// Every CRD muster serves.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![workload_crd()]
}

/// The Workload CRD. The embedded pod template keeps its full schema (so the API server
/// validates and prunes it) but without the field descriptions of the core Pod API:
/// those would make the CRD larger than `kubectl apply` can store in its annotation.
fn workload_crd() -> CustomResourceDefinition {
    let mut crd = Workload::crd();
    for version in &mut crd.spec.versions {
        let template = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .and_then(|root| root.properties.as_mut()?.get_mut("spec"))
            .and_then(|spec| spec.properties.as_mut()?.get_mut("podGroups"))
            .and_then(|groups| match groups.items.as_mut()? {
                JSONSchemaPropsOrArray::Schema(item) => item.properties.as_mut()?.get_mut("template"),
                JSONSchemaPropsOrArray::Schemas(_) => None,
            });
        if let Some(template) = template {
            for child in template.properties.iter_mut().flat_map(|p| p.values_mut()) {
                strip_descriptions(child);
            }
        }
        if let Some(root) = version.schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut()) {
            unwrap_descriptions(root);
        }
    }
    crd
}

/// Doc comments wrap lines; `kubectl explain` wraps again. Keep only paragraph breaks.
fn unwrap_descriptions(schema: &mut JSONSchemaProps) {
    if let Some(text) = schema.description.as_mut() {
        *text = text
            .split("\n\n")
            .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
            .join("\n\n");
    }
    for child in schema.properties.iter_mut().flat_map(|p| p.values_mut()) {
        unwrap_descriptions(child);
    }
    if let Some(JSONSchemaPropsOrArray::Schema(item)) = schema.items.as_mut() {
        unwrap_descriptions(item);
    }
}

fn strip_descriptions(schema: &mut JSONSchemaProps) {
    schema.description = None;
    for child in schema.properties.iter_mut().flat_map(|p| p.values_mut()) {
        strip_descriptions(child);
    }
    match schema.items.as_mut() {
        Some(JSONSchemaPropsOrArray::Schema(item)) => strip_descriptions(item),
        Some(JSONSchemaPropsOrArray::Schemas(items)) => items.iter_mut().for_each(strip_descriptions),
        None => {}
    }
    if let Some(JSONSchemaPropsOrBool::Schema(extra)) = schema.additional_properties.as_mut() {
        strip_descriptions(extra);
    }
    for list in [&mut schema.all_of, &mut schema.any_of, &mut schema.one_of] {
        list.iter_mut().flatten().for_each(strip_descriptions);
    }
}

/// File name of a CRD in the `crds/` directory: `<plural>.<group>.yaml`.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or("crd"))
}

/// One CRD as a YAML document.
pub fn to_yaml(crd: &CustomResourceDefinition) -> Result<String, CrdError> {
    serde_saphyr::to_string(crd).map_err(|source| CrdError::Yaml {
        name: crd.metadata.name.clone().unwrap_or_default(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paths of schema properties without a description, below `path`.
    fn undescribed(schema: &JSONSchemaProps, path: &str, out: &mut Vec<String>) {
        for (name, child) in schema.properties.iter().flatten() {
            let child_path = format!("{path}.{name}");
            if child.description.as_deref().is_none_or(str::is_empty) {
                out.push(child_path.clone());
            }
            // Inside, the embedded pod template is the core API's, documented by
            // `kubectl explain pod`.
            if !child_path.ends_with("podGroups[].template") {
                undescribed(child, &child_path, out);
            }
        }
        if let Some(JSONSchemaPropsOrArray::Schema(item)) = &schema.items {
            undescribed(item, &format!("{path}[]"), out);
        }
    }

    #[test]
    fn every_field_has_a_description_for_kubectl_explain() {
        let crd = workload_crd();
        let root = crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("schema");
        let mut missing = Vec::new();
        for part in ["spec", "status"] {
            let schema = &root.properties.as_ref().expect("properties")[part];
            undescribed(schema, part, &mut missing);
        }
        assert!(missing.is_empty(), "fields without a description: {missing:#?}");
    }
}
