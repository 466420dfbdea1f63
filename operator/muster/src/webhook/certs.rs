//! The webhook's serving certificate when no cert-manager provides one: muster keeps a
//! CA and a serving certificate signed by it in a Secret, renews each at two thirds of
//! its lifetime, and writes the CA into the webhook configuration's `caBundle`. While a
//! CA is replaced, the bundle holds the old one too, so that a replica still serving a
//! certificate of the old CA stays trusted until it reloads.

use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use time::OffsetDateTime;

/// Keys of the Secret.
pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const TLS_CERT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("making a certificate failed: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("the stored certificate is not readable: {0}")]
    Parse(String),
}

/// The PEM texts muster keeps. `ca_bundle` is the current CA first, then a previous one
/// still trusted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bundle {
    pub ca_bundle: String,
    pub ca_key: String,
    pub cert: String,
    pub key: String,
}

/// A certificate's validity and names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
    pub names: Vec<String>,
}

/// Validity and subject alternative names of the first certificate of `pem`.
pub fn facts(pem: &str) -> Result<Facts, CertError> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|e| CertError::Parse(e.to_string()))?;
    let cert = block.parse_x509().map_err(|e| CertError::Parse(e.to_string()))?;
    let validity = cert.validity();
    let mut names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                x509_parser::extensions::GeneralName::DNSName(dns) => names.push(dns.to_string()),
                x509_parser::extensions::GeneralName::IPAddress(bytes) => {
                    let ip = match bytes.len() {
                        4 => <[u8; 4]>::try_from(*bytes)
                            .ok()
                            .map(|b| std::net::IpAddr::from(b).to_string()),
                        16 => <[u8; 16]>::try_from(*bytes)
                            .ok()
                            .map(|b| std::net::IpAddr::from(b).to_string()),
                        _ => None,
                    };
                    names.extend(ip);
                }
                _ => {}
            }
        }
    }
    names.sort();
    Ok(Facts {
        not_before: validity.not_before.to_datetime(),
        not_after: validity.not_after.to_datetime(),
        names,
    })
}

/// Whether a certificate is due for renewal at `now`: two thirds of its lifetime gone.
pub fn due(facts: &Facts, now: OffsetDateTime) -> bool {
    let lifetime = facts.not_after - facts.not_before;
    now >= facts.not_before + lifetime * 2 / 3 || now < facts.not_before
}

/// What must be made anew for `names` at `now`: `(ca, serving)`.
pub fn renewal(stored: Option<&Bundle>, names: &[String], now: OffsetDateTime) -> (bool, bool) {
    let Some(stored) = stored else {
        return (true, true);
    };
    let ca = match facts(&stored.ca_bundle) {
        Ok(ca) => ca,
        Err(_) => return (true, true),
    };
    let ca_due = due(&ca, now) || KeyPair::from_pem(&stored.ca_key).is_err();
    let mut wanted: Vec<String> = names.to_vec();
    wanted.sort();
    let serving_due = match facts(&stored.cert) {
        Ok(serving) => due(&serving, now) || serving.names != wanted || serving.not_after > ca.not_after,
        Err(_) => true,
    } || KeyPair::from_pem(&stored.key).is_err();
    (ca_due, ca_due || serving_due)
}

fn validity(params: &mut CertificateParams, now: OffsetDateTime, lifetime: Duration) {
    // A minute of slack for clocks that lag behind.
    params.not_before = now - time::Duration::minutes(1);
    params.not_after = now + time::Duration::try_from(lifetime).unwrap_or(time::Duration::days(365));
}

/// A fresh CA valid for `lifetime`: (certificate, key) in PEM.
fn new_ca(now: OffsetDateTime, lifetime: Duration) -> Result<(String, String), CertError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, "muster-webhook-ca");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    validity(&mut params, now, lifetime);
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Renews what [`renewal`] says is due. `serving_lifetime` is the serving certificate's;
/// a CA lives ten times as long.
pub fn renew(
    stored: Option<&Bundle>,
    names: &[String],
    now: OffsetDateTime,
    serving_lifetime: Duration,
) -> Result<Option<Bundle>, CertError> {
    let (ca_due, serving_due) = renewal(stored, names, now);
    if !serving_due {
        return Ok(None);
    }
    let (ca_cert, ca_key, ca_bundle) = match stored.filter(|_| !ca_due) {
        Some(stored) => {
            let current = first_pem(&stored.ca_bundle);
            (current, stored.ca_key.clone(), stored.ca_bundle.clone())
        }
        None => {
            let (cert, key) = new_ca(now, serving_lifetime * 10)?;
            // The previous CA stays trusted until it expires.
            let previous = stored
                .map(|s| first_pem(&s.ca_bundle))
                .filter(|pem| facts(pem).is_ok_and(|f| f.not_after > now));
            let bundle = match previous {
                Some(previous) => format!("{cert}{previous}"),
                None => cert.clone(),
            };
            (cert, key, bundle)
        }
    };
    let ca_key_pair = KeyPair::from_pem(&ca_key)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_cert, &ca_key_pair)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names.to_vec())?;
    params.distinguished_name.push(DnType::CommonName, "muster-webhook");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    validity(&mut params, now, serving_lifetime);
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Some(Bundle {
        ca_bundle,
        ca_key,
        cert: cert.pem(),
        key: key.serialize_pem(),
    }))
}

/// The first PEM block of `text`.
fn first_pem(text: &str) -> String {
    const END: &str = "-----END CERTIFICATE-----";
    match text.find(END) {
        Some(at) => format!("{}\n", &text[..at + END.len()]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["muster-webhook.muster-system.svc".into(), "127.0.0.1".into()]
    }

    #[test]
    fn a_bundle_is_made_once_and_renewed_at_two_thirds_of_its_life() {
        let start = OffsetDateTime::now_utc();
        let year = Duration::from_secs(365 * 24 * 3600);
        let bundle = renew(None, &names(), start, year).unwrap().expect("made");
        let serving = facts(&bundle.cert).unwrap();
        let mut expected = names();
        expected.sort();
        assert_eq!(serving.names, expected);
        assert_eq!(renew(Some(&bundle), &names(), start, year).unwrap(), None, "fresh");
        // Eight months on: the serving certificate is renewed under the same CA.
        let later = start + time::Duration::days(245);
        let renewed = renew(Some(&bundle), &names(), later, year).unwrap().expect("renewed");
        assert_eq!(renewed.ca_bundle, bundle.ca_bundle);
        assert_ne!(renewed.cert, bundle.cert);
        // Another name: renewed at once.
        let other = vec!["other.svc".to_string()];
        assert!(renew(Some(&bundle), &other, start, year).unwrap().is_some());
        // Seven years on the CA is due: a new one, the old one kept in the bundle while valid.
        let much_later = start + time::Duration::days(7 * 365);
        let rotated = renew(Some(&bundle), &names(), much_later, year)
            .unwrap()
            .expect("rotated");
        assert!(rotated.ca_bundle.ends_with(&bundle.ca_bundle), "old CA still trusted");
        assert_ne!(first_pem(&rotated.ca_bundle), first_pem(&bundle.ca_bundle));
    }

    #[test]
    fn a_broken_secret_is_made_anew() {
        let broken = Bundle {
            ca_bundle: "not a certificate".into(),
            ..Bundle::default()
        };
        assert_eq!(
            renewal(Some(&broken), &names(), OffsetDateTime::now_utc()),
            (true, true)
        );
    }
}
