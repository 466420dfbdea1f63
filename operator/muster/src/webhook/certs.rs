//! The webhook's serving certificate when no cert-manager provides one: muster keeps a
//! CA and a serving certificate signed by it in a Secret, renews each at two thirds of
//! its lifetime, and writes the CAs into the webhook configuration's `caBundle`.
//!
//! A new CA is trusted before anything is served from it: it is first added to the
//! bundle beside the CA still in use ([`Renewal::NewCa`]); only once the configuration's
//! `caBundle` holds it is a serving certificate issued from it
//! ([`Renewal::NewServing`]). A CA stays in the bundle until it expires, so a replica
//! still serving a certificate of an older CA stays trusted until it reloads. A serving
//! certificate never outlives its CA, so it is not renewed again at every check.

use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use time::OffsetDateTime;

/// Keys of the Secret.
pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const TLS_CERT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";

/// Validity begins this long before a certificate is made, for clocks that lag behind.
const SLACK: time::Duration = time::Duration::minutes(1);

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("making a certificate failed: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("the stored certificate is not readable: {0}")]
    Parse(String),
}

/// The PEM texts muster keeps. `ca_bundle` is the current CA first (the one `ca_key`
/// signs with), then older CAs still trusted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bundle {
    pub ca_bundle: String,
    pub ca_key: String,
    pub cert: String,
    pub key: String,
}

/// A certificate's validity, names, subject and issuer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
    pub names: Vec<String>,
    pub subject: String,
    pub issuer: String,
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
        subject: cert.subject().to_string(),
        issuer: cert.issuer().to_string(),
    })
}

/// Whether a certificate is due for renewal at `now`: two thirds of its lifetime gone
/// (counted from when it was made, after the slack), or not valid yet.
pub fn due(facts: &Facts, now: OffsetDateTime) -> bool {
    let made = (facts.not_before + SLACK).min(facts.not_after);
    let lifetime = facts.not_after - made;
    now >= made + lifetime * 2 / 3 || now < facts.not_before
}

/// What a check must make anew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// Everything is current.
    Nothing,
    /// A new CA, added to the bundle; the serving certificate stays until the bundle
    /// that trusts the new CA is in the webhook configuration.
    NewCa,
    /// A serving certificate from the current CA.
    NewServing,
    /// Both at once: nothing usable is stored.
    Everything,
}

/// What must be made anew for `names` at `now`. `trusted`: whether the webhook
/// configuration's `caBundle` holds the current CA.
pub fn renewal(stored: Option<&Bundle>, names: &[String], now: OffsetDateTime, trusted: bool) -> Renewal {
    let Some(stored) = stored else {
        return Renewal::Everything;
    };
    let Ok(ca) = facts(&stored.ca_bundle) else {
        return Renewal::Everything;
    };
    let serving = facts(&stored.cert)
        .ok()
        .filter(|_| KeyPair::from_pem(&stored.key).is_ok());
    let usable = serving
        .as_ref()
        .is_some_and(|s| now < s.not_after && now >= s.not_before && issuer_pem(stored, s).is_some());
    let ca_usable = now < ca.not_after && KeyPair::from_pem(&stored.ca_key).is_ok();
    if !ca_usable {
        return Renewal::Everything;
    }
    if due(&ca, now) {
        // Nothing served yet: no one relies on the old CA.
        return if usable { Renewal::NewCa } else { Renewal::Everything };
    }
    let mut wanted: Vec<String> = names.to_vec();
    wanted.sort();
    let Some(serving) = serving.filter(|_| usable) else {
        return Renewal::NewServing;
    };
    let from_current = serving.issuer == ca.subject;
    if serving.names != wanted || due(&serving, now) || (!from_current && trusted) {
        return Renewal::NewServing;
    }
    Renewal::Nothing
}

/// The PEM of the CA in the bundle that issued `serving`.
fn issuer_pem(stored: &Bundle, serving: &Facts) -> Option<String> {
    pems(&stored.ca_bundle)
        .into_iter()
        .find(|pem| facts(pem).is_ok_and(|ca| ca.subject == serving.issuer))
}

fn validity(params: &mut CertificateParams, now: OffsetDateTime, lifetime: Duration, until: Option<OffsetDateTime>) {
    params.not_before = now - SLACK;
    let end = now + time::Duration::try_from(lifetime).unwrap_or(time::Duration::days(365));
    params.not_after = until.map_or(end, |until| end.min(until));
}

/// A fresh CA valid for `lifetime`: (certificate, key) in PEM. Its name carries the
/// time it was made, so that the CA that issued a certificate can be told apart.
fn new_ca(now: OffsetDateTime, lifetime: Duration) -> Result<(String, String), CertError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(
        DnType::CommonName,
        format!("muster-webhook-ca {}", now.unix_timestamp_nanos()),
    );
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    validity(&mut params, now, lifetime, None);
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A serving certificate for `names` from the CA `ca_cert`/`ca_key`, valid for
/// `lifetime` but never past the CA.
fn new_serving(
    ca_cert: &str,
    ca_key: &str,
    names: &[String],
    now: OffsetDateTime,
    lifetime: Duration,
) -> Result<(String, String), CertError> {
    let ca_key_pair = KeyPair::from_pem(ca_key)?;
    let issuer = Issuer::from_ca_cert_pem(ca_cert, &ca_key_pair)?;
    let ca_end = facts(ca_cert)?.not_after;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names.to_vec())?;
    params.distinguished_name.push(DnType::CommonName, "muster-webhook");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    validity(&mut params, now, lifetime, Some(ca_end));
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Lifetimes of what muster makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetimes {
    pub serving: Duration,
    pub ca: Duration,
}

/// Renews what [`renewal`] says is due; `None` when nothing is.
pub fn renew(
    stored: Option<&Bundle>,
    names: &[String],
    now: OffsetDateTime,
    lifetimes: Lifetimes,
    trusted: bool,
) -> Result<Option<Bundle>, CertError> {
    // CAs of the stored bundle still valid at `now`.
    let still_valid = |bundle: &str| -> String {
        pems(bundle)
            .into_iter()
            .filter(|pem| facts(pem).is_ok_and(|f| f.not_after > now))
            .collect()
    };
    match (renewal(stored, names, now, trusted), stored) {
        (Renewal::Nothing, _) => Ok(None),
        (Renewal::NewCa, Some(stored)) => {
            let (cert, key) = new_ca(now, lifetimes.ca)?;
            Ok(Some(Bundle {
                ca_bundle: format!("{cert}{}", still_valid(&stored.ca_bundle)),
                ca_key: key,
                ..stored.clone()
            }))
        }
        (Renewal::NewServing, Some(stored)) => {
            let current = pems(&stored.ca_bundle).into_iter().next().unwrap_or_default();
            let (cert, key) = new_serving(&current, &stored.ca_key, names, now, lifetimes.serving)?;
            Ok(Some(Bundle {
                ca_bundle: still_valid(&stored.ca_bundle),
                ca_key: stored.ca_key.clone(),
                cert,
                key,
            }))
        }
        (Renewal::Everything | Renewal::NewCa | Renewal::NewServing, stored) => {
            let (ca_cert, ca_key) = new_ca(now, lifetimes.ca)?;
            let (cert, key) = new_serving(&ca_cert, &ca_key, names, now, lifetimes.serving)?;
            let older = stored.map(|s| still_valid(&s.ca_bundle)).unwrap_or_default();
            Ok(Some(Bundle {
                ca_bundle: format!("{ca_cert}{older}"),
                ca_key,
                cert,
                key,
            }))
        }
    }
}

/// The PEM blocks of certificates in `text`.
pub fn pems(text: &str) -> Vec<String> {
    const END: &str = "-----END CERTIFICATE-----";
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(END) {
        let block = rest[..at + END.len()].trim_start();
        if !block.is_empty() {
            out.push(format!("{block}\n"));
        }
        rest = &rest[at + END.len()..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["muster-webhook.muster-system.svc".into(), "127.0.0.1".into()]
    }

    fn lifetimes(serving: u64) -> Lifetimes {
        Lifetimes {
            serving: Duration::from_secs(serving),
            ca: Duration::from_secs(serving * 10),
        }
    }

    #[test]
    fn a_bundle_is_made_once_and_renewed_at_two_thirds_of_its_life() {
        let start = OffsetDateTime::now_utc();
        let year = 365 * 24 * 3600;
        let bundle = renew(None, &names(), start, lifetimes(year), false)
            .unwrap()
            .expect("made");
        let serving = facts(&bundle.cert).unwrap();
        let mut expected = names();
        expected.sort();
        assert_eq!(serving.names, expected);
        assert_eq!(
            renew(Some(&bundle), &names(), start, lifetimes(year), true).unwrap(),
            None,
            "fresh"
        );
        // Eight months on: the serving certificate is renewed under the same CA.
        let later = start + time::Duration::days(245);
        let renewed = renew(Some(&bundle), &names(), later, lifetimes(year), true)
            .unwrap()
            .expect("renewed");
        assert_eq!(renewed.ca_bundle, bundle.ca_bundle);
        assert_ne!(renewed.cert, bundle.cert);
        // Another name: renewed at once.
        let other = vec!["other.svc".to_string()];
        assert!(
            renew(Some(&bundle), &other, start, lifetimes(year), true)
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn a_new_ca_is_trusted_before_anything_is_served_from_it() {
        let start = OffsetDateTime::now_utc();
        let bundle = renew(None, &names(), start, lifetimes(3600), false).unwrap().unwrap();
        // Seven of the CA's ten hours on (the serving certificate renewed meanwhile).
        let much_later = start + time::Duration::hours(7);
        let serving = renew(
            Some(&bundle),
            &names(),
            much_later - time::Duration::minutes(30),
            lifetimes(3600),
            true,
        )
        .unwrap()
        .unwrap();
        let rotated = renew(Some(&serving), &names(), much_later, lifetimes(3600), true)
            .unwrap()
            .expect("a new CA");
        assert_eq!(rotated.cert, serving.cert, "still served from the old CA");
        assert_eq!(pems(&rotated.ca_bundle).len(), 2, "both CAs trusted");
        assert_eq!(pems(&rotated.ca_bundle)[1], pems(&bundle.ca_bundle)[0]);
        // Until the configuration trusts the new CA, nothing is served from it.
        assert_eq!(renewal(Some(&rotated), &names(), much_later, false), Renewal::Nothing);
        let moved = renew(Some(&rotated), &names(), much_later, lifetimes(3600), true)
            .unwrap()
            .expect("served from the new CA");
        let ca = facts(&pems(&moved.ca_bundle)[0]).unwrap();
        assert_eq!(facts(&moved.cert).unwrap().issuer, ca.subject);
        assert_eq!(renewal(Some(&moved), &names(), much_later, true), Renewal::Nothing);
        // Once the old CA expires it leaves the bundle.
        let after = start + time::Duration::hours(11);
        let pruned = renew(Some(&moved), &names(), after, lifetimes(3600), true)
            .unwrap()
            .unwrap();
        assert_eq!(pems(&pruned.ca_bundle).len(), 1);
    }

    #[test]
    fn a_serving_lifetime_longer_than_the_cas_is_cut_not_renewed_in_a_loop() {
        let start = OffsetDateTime::now_utc();
        let short_ca = Lifetimes {
            serving: Duration::from_secs(3600),
            ca: Duration::from_secs(1800),
        };
        let bundle = renew(None, &names(), start, short_ca, false).unwrap().unwrap();
        let (serving, ca) = (facts(&bundle.cert).unwrap(), facts(&bundle.ca_bundle).unwrap());
        assert!(serving.not_after <= ca.not_after);
        assert_eq!(
            renewal(Some(&bundle), &names(), start + time::Duration::seconds(5), true),
            Renewal::Nothing
        );
        // Short lifetimes are not due at once for the clock slack.
        let quick = renew(None, &names(), start, lifetimes(15), false).unwrap().unwrap();
        assert_eq!(
            renewal(Some(&quick), &names(), start + time::Duration::seconds(2), true),
            Renewal::Nothing
        );
        assert_eq!(
            renewal(Some(&quick), &names(), start + time::Duration::seconds(11), true),
            Renewal::NewServing
        );
    }

    #[test]
    fn a_broken_secret_is_made_anew() {
        let broken = Bundle {
            ca_bundle: "not a certificate".into(),
            ..Bundle::default()
        };
        assert_eq!(
            renewal(Some(&broken), &names(), OffsetDateTime::now_utc(), true),
            Renewal::Everything
        );
    }
}
