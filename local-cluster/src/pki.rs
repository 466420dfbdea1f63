//! Certificates for a local control plane: one CA, the API server's serving certificate,
//! an admin client certificate (group system:masters) and the service-account signing key.

use std::fs;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// Paths of the PEM files written by [`Pki::generate`].
#[derive(Clone, Debug)]
pub struct Pki {
    pub ca_cert: PathBuf,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    pub admin_cert: PathBuf,
    pub admin_key: PathBuf,
    /// kube-controller-manager's client certificate (user `system:kube-controller-manager`).
    pub controller_manager_cert: PathBuf,
    pub controller_manager_key: PathBuf,
    pub service_account_key: PathBuf,
    pub service_account_public_key: PathBuf,
}

impl Pki {
    /// Writes a fresh PKI into `dir`.
    pub fn generate(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir)?;
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::default();
        ca_params.distinguished_name = name("muster-e2e-ca", None);
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);

        let serving_key = KeyPair::generate()?;
        let mut serving = CertificateParams::default();
        serving.distinguished_name = name("kube-apiserver", None);
        serving.subject_alt_names = vec![
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))),
            SanType::DnsName("localhost".try_into()?),
            SanType::DnsName("kubernetes".try_into()?),
            SanType::DnsName("kubernetes.default".try_into()?),
            SanType::DnsName("kubernetes.default.svc".try_into()?),
            SanType::DnsName("kubernetes.default.svc.cluster.local".try_into()?),
        ];
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        serving.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        let serving_cert = serving.signed_by(&serving_key, &issuer)?;

        let admin_key = KeyPair::generate()?;
        let mut admin = CertificateParams::default();
        admin.distinguished_name = name("muster-e2e-admin", Some("system:masters"));
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        admin.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        let admin_cert = admin.signed_by(&admin_key, &issuer)?;

        // kube-controller-manager as on a real cluster: its own user, and each controller
        // through its ServiceAccount (`--use-service-account-credentials`), so that
        // policies which tell the garbage collector from a user see what they would.
        let controller_manager_key = KeyPair::generate()?;
        let mut controller_manager = CertificateParams::default();
        controller_manager.distinguished_name = name("system:kube-controller-manager", None);
        controller_manager.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        controller_manager.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        let controller_manager_cert = controller_manager.signed_by(&controller_manager_key, &issuer)?;

        let service_account_key = KeyPair::generate()?;

        let pki = Pki {
            ca_cert: dir.join("ca.crt"),
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            admin_cert: dir.join("admin.crt"),
            admin_key: dir.join("admin.key"),
            controller_manager_cert: dir.join("controller-manager.crt"),
            controller_manager_key: dir.join("controller-manager.key"),
            service_account_key: dir.join("sa.key"),
            service_account_public_key: dir.join("sa.pub"),
        };
        write(&pki.ca_cert, &ca_cert.pem())?;
        write(&pki.serving_cert, &serving_cert.pem())?;
        write(&pki.serving_key, &serving_key.serialize_pem())?;
        write(&pki.admin_cert, &admin_cert.pem())?;
        write(&pki.admin_key, &admin_key.serialize_pem())?;
        write(&pki.controller_manager_cert, &controller_manager_cert.pem())?;
        write(&pki.controller_manager_key, &controller_manager_key.serialize_pem())?;
        write(&pki.service_account_key, &service_account_key.serialize_pem())?;
        write(&pki.service_account_public_key, &service_account_key.public_key_pem())?;
        Ok(pki)
    }
}

fn name(common_name: &str, organization: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    if let Some(org) = organization {
        dn.push(DnType::OrganizationName, org);
    }
    dn
}

fn write(path: &Path, contents: &str) -> Result<()> {
    fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}
